// Products of Q5_0, Q8_0, Q4_1 and Q5_1 weights with activation rows.
//
// ggml has neither a repacked nor an AMX kernel for Q5_0 and Q5_1, the types that Q4_K_M and Q5_K_M
// files fall back to for weights whose width is no multiple of 256 (most of Qwen2.5-0.5B's), and on
// x86 it repacks Q8_0 (a DFlash drafter's weights) and Q4_1 (SmolLM2's as shipped) only for AMX. It
// multiplies them by calling ggml_vec_dot_q5_0_q8_0 / _q8_0_q8_0 / _q4_1_q8_1 / _q5_1_q8_1 once per (weight
// row, activation row): per 32-wide block it takes the integer dot products of the weights (Q5_0's
// unpacked to signed bytes) with the activations' q8_0 (q8_1) block in 8 lanes of 4, and adds them,
// times the two blocks' scales, into 8 float accumulators (fused multiply-adds in block order),
// reduced at the end as hsum_float_8 (Q4_1 and Q5_1 add their minimums' sum). On a 2-core Xeon that is 57% of
// a Qwen2.5-Coder-0.5B step (BENCHMARKS.md (n)); on a 2-core EPYC without AMX the drafter's Q8_0
// products are most of its call (BENCHMARKS.md (p)).
//
// This kernel gives every output the value ggml's gives it: the same exact integer lane sums (here
// the weights made unsigned, w + 16 for Q5_0 and w + 128 for Q8_0, times the activations, counted
// from -16 or -128 times the activations' lane sums: ggml's signed product; Q4_1's and Q5_1's are
// unsigned),
// the same scale product, the same chain of fused multiply-adds in block order, the same reduction.
// What changes: the activations' scales and lane sums are prepared once per product; for several
// activation rows each weight block is read once for up to four of them and four weight rows run
// side by side, so that their chains overlap; for one (a plain step) the weights stream one row at
// a time, as ggml reads them, each block with fewer instructions. It plugs in as one of ggml's CPU
// "extra buffer types" (vendor/cpu_extra.h), one per weight type, and takes 2-D products of such
// weights in host memory by f32 activations.
//
// Built for AVX-512 CPUs with VNNI (where ggml's dot products are its AVX2 ones) in the same
// `-march=native` build as llama.cpp; elsewhere dflash2_set_q5_0_rows(), dflash2_set_q8_0_rows()
// and dflash2_set_q4_1_rows() (Q4_1 and Q5_1) report that it is not built.

#include "dflash2_shim.h"
#include "cpu_extra.h"

#include "ggml-backend.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__) && defined(__F16C__)
#define DFLASH2_QUANT_ROWS 1
#include "ggml-cpu/quants.h"  // quantize_row_q8_0 (ggml's quantizer for the activations), the block types
#include <immintrin.h>
#else
#define DFLASH2_QUANT_ROWS 0
#endif

#if DFLASH2_QUANT_ROWS
namespace {

constexpr int QK = 32;

using dflash2::q8_0_operand;

// How far ahead of its reads a tile over several activation rows asks for a weight row's blocks
// (the hardware prefetcher alone leaves the products waiting on them: 10% of a drafter call on a
// 2-core EPYC; a single activation row reads the weights in order, which the prefetcher follows).
constexpr int PREFETCH_BLOCKS = 32;

// The weight types: a block's 32 weights as unsigned bytes w + 2^shift, in ggml's order, and the
// activation rows quantized as ggml quantizes them for the type's dot product (into `scratch`), as
// operands; `with_min`: a type whose blocks add a minimum times the activations' block sum (`sums`).
template <int shift> struct q8_0_activations {
    static constexpr bool with_min = false;
    static constexpr bool offset = true;  // unsigned weights counted from -2^shift times the lane sums
    static void operands(const float * x, int64_t k, void * scratch, q8_0_operand * out, float *) {
        dflash2::q8_0_operands<shift>(x, k, static_cast<block_q8_0 *>(scratch), out);
    }
};

// A Q5_0 or Q5_1 block's 5-bit numbers: the low nibbles of qs are weights 0..15, the high nibbles
// 16..31, bit k of qh is weight k's fifth bit.
template <class Block> inline __m256i five_bit_numbers(const Block & b) {
    __m256i bytes = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *) b.qs));
    bytes = _mm256_srlv_epi64(bytes, _mm256_set_epi64x(4, 4, 0, 0));
    bytes = _mm256_and_si256(bytes, _mm256_set1_epi8(0x0F));
    uint32_t qh;
    std::memcpy(&qh, b.qh, sizeof(qh));
    return _mm256_mask_add_epi8(bytes, (__mmask32) qh, bytes, _mm256_set1_epi8(16));
}

struct q5_0 : q8_0_activations<4> {
    using block = block_q5_0;
    static constexpr ggml_type type = GGML_TYPE_Q5_0;
    // w + 16 is the 5-bit number itself
    static __m256i unsigned_weights(const block & b) { return five_bit_numbers(b); }
};

struct q8_0 : q8_0_activations<7> {
    using block = block_q8_0;
    static constexpr ggml_type type = GGML_TYPE_Q8_0;
    static __m256i unsigned_weights(const block & b) { return dflash2::unsigned_q8_0(b); }
};

// ggml_vec_dot_q4_1_q8_1: the nibbles are unsigned already (low ones weights 0..15, high ones
// 16..31), the activations q8_1 blocks; each output adds its blocks' minimums times the activation
// blocks' sums, summed in block order, to the reduction (ggml's compiler fuses `summs += m * s`; the
// product of two halves is exact in float, so fused or not, the sum is the same).
struct q4_1 {
    using block = block_q4_1;
    static constexpr ggml_type type = GGML_TYPE_Q4_1;
    static constexpr bool with_min = true;
    static constexpr bool offset = false;
    static __m256i unsigned_weights(const block & b) {
        const __m128i bytes = _mm_loadu_si128((const __m128i *) b.qs);
        const __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(bytes), _mm_srli_epi16(bytes, 4), 1);
        return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
    }
    static void operands(const float * x, int64_t k, void * scratch, q8_0_operand * out, float * sums) {
        auto * quants = static_cast<block_q8_1 *>(scratch);
        quantize_row_q8_1(x, quants, k);
        for (int64_t b = 0; b < k / QK; ++b) {  // no lane sums: the product starts from zero (offset)
            std::memcpy(out[b].qs, quants[b].qs, QK);
            out[b].d = _cvtsh_ss(quants[b].d);
            sums[b] = _cvtsh_ss(quants[b].s);
        }
    }
};

// ggml_vec_dot_q5_1_q8_1: Q4_1's arithmetic (unsigned weights, the minimums' part summed as Q4_1's)
// with Q5_0's 5-bit numbers.
struct q5_1 : q4_1 {
    using block = block_q5_1;
    static constexpr ggml_type type = GGML_TYPE_Q5_1;
    static __m256i unsigned_weights(const block & b) { return five_bit_numbers(b); }
};


// The largest work buffer the kernel asks for (a prompt batch is the most); beyond, ggml's own.
constexpr size_t MAX_WORK = size_t(64) << 20;

// Per activation block: its operand, ggml's quantized block (q8_1, the larger), its sum (q8_1's s).
inline size_t work_for(int64_t rows, int64_t blocks) {
    return size_t(rows * blocks) * (sizeof(q8_0_operand) + sizeof(block_q8_1) + sizeof(float));
}

// R weight rows (x, stride `stride` bytes) times G activation rows (their blocks' sums in `sums`
// where W has minimums), each output as ggml's vec_dot_<W>_<q8_0 or q8_1> computes it; out[g][r]
// receives row r's product with activation row g.
template <class W, int R, int G>
inline void tile(int64_t blocks, const char * x, size_t stride, const q8_0_operand * const * act, const float * const * sums,
                 float * const * out) {
    __m256 acc[R][G];
    __m128 mins[R];  // lane g: weight row r's minimums times activation row g's sums, so far
    for (int r = 0; r < R; ++r) {
        for (int g = 0; g < G; ++g) acc[r][g] = _mm256_setzero_ps();
        mins[r] = _mm_setzero_ps();
    }
    for (int64_t ib = 0; ib < blocks; ++ib) {
        __m128 block_sums = _mm_setzero_ps();  // lane g: activation row g's sum of this block
        if constexpr (W::with_min) {  // inserted lane by lane: a store and a wider load would stall
            block_sums = _mm_load_ss(&sums[0][ib]);
            if constexpr (G > 1) block_sums = _mm_insert_ps(block_sums, _mm_load_ss(&sums[1][ib]), 0x10);
            if constexpr (G > 2) block_sums = _mm_insert_ps(block_sums, _mm_load_ss(&sums[2][ib]), 0x20);
            if constexpr (G > 3) block_sums = _mm_insert_ps(block_sums, _mm_load_ss(&sums[3][ib]), 0x30);
        }
        for (int r = 0; r < R; ++r) {
            const typename W::block & b = ((const typename W::block *) (x + r * stride))[ib];
            if (G > 1) {
                _mm_prefetch((const char *) (&b + PREFETCH_BLOCKS), _MM_HINT_T0);
            }
            const __m256i w = W::unsigned_weights(b);
            const __m256 xd = _mm256_set1_ps(_cvtsh_ss(b.d));
            for (int g = 0; g < G; ++g) acc[r][g] = dflash2::q8_0_dot_step<W::offset>(acc[r][g], w, xd, act[g][ib]);
            if constexpr (W::with_min) {
                mins[r] = _mm_fmadd_ps(_mm_set1_ps(_cvtsh_ss(b.m)), block_sums, mins[r]);
            }
        }
    }
    for (int r = 0; r < R; ++r) {
        alignas(16) float m[4];
        _mm_store_ps(m, mins[r]);
        for (int g = 0; g < G; ++g) out[g][r] = W::with_min ? dflash2::hsum_float_8(acc[r][g]) + m[g] : dflash2::hsum_float_8(acc[r][g]);
    }
}

template <class W, int R>
inline void tile(int G, int64_t blocks, const char * x, size_t stride, const q8_0_operand * const * act, const float * const * sums,
                 float * const * out) {
    switch (G) {
        case 1: tile<W, R, 1>(blocks, x, stride, act, sums, out); break;
        case 2: tile<W, R, 2>(blocks, x, stride, act, sums, out); break;
        case 3: tile<W, R, 3>(blocks, x, stride, act, sums, out); break;
        default: tile<W, R, 4>(blocks, x, stride, act, sums, out); break;
    }
}

template <class W> class rows_traits : public ggml::cpu::tensor_traits {
  public:
    // A 2-D weight of type W, of rows a multiple of 8 (whole runs; real models' are), in host
    // memory (ggml's plain CPU buffer: not repacked) by 2-D f32 activations, into f32.
    static bool takes(const ggml_tensor * op) {
        const ggml_tensor * x = op->src[0];
        const ggml_tensor * y = op->src[1];
        return op->op == GGML_OP_MUL_MAT && x && y && x->type == W::type && y->type == GGML_TYPE_F32 &&
               op->type == GGML_TYPE_F32 && x->ne[0] % QK == 0 && x->ne[1] % 8 == 0 && x->ne[2] == 1 && x->ne[3] == 1 && y->ne[2] == 1 &&
               y->ne[3] == 1 && x->nb[0] == sizeof(typename W::block) && y->nb[0] == sizeof(float) && op->nb[0] == sizeof(float) &&
               work_for(y->ne[1], x->ne[0] / QK) <= MAX_WORK && !x->extra &&
               (!x->buffer || ggml_backend_buffer_is_host(x->buffer));  // no buffer: a plain ggml context's memory
    }

    bool work_size(int, const ggml_tensor * op, size_t & size) override {
        size = work_for(op->src[1]->ne[1], op->src[0]->ne[0] / QK);
        return true;
    }

    bool compute_forward(ggml_compute_params * params, ggml_tensor * op) override {
        if (params->use_ref) {
            return false;  // the reference kernels were asked for
        }
        const ggml_tensor * x = op->src[0];
        const ggml_tensor * y = op->src[1];
        const int64_t k = x->ne[0], blocks = k / QK, n = x->ne[1], m = y->ne[1];
        q8_0_operand * acts = static_cast<q8_0_operand *>(params->wdata);
        float * block_sums = reinterpret_cast<float *>(acts + m * blocks);
        block_q8_1 * quants = reinterpret_cast<block_q8_1 *>(block_sums + m * blocks);

        // Every activation row quantized as ggml quantizes it, split between the threads.
        for (int64_t i = params->ith; i < m; i += params->nth) {
            W::operands((const float *) ((const char *) y->data + i * y->nb[1]), k, quants + i * blocks, acts + i * blocks,
                        block_sums + i * blocks);
        }
        ggml_barrier(params->threadpool);

        // The weight rows, split between the threads in runs of R: one row at a time for one
        // activation row (a stream of weights, as ggml reads it: on a 2-core EPYC, eight rows side
        // by side made a step 20% slower than ggml's), four for more, each then meeting the
        // activation rows four at a time.
        const int R = m == 1 ? 1 : 4;
        const int64_t runs = (n + R - 1) / R;
        const int64_t first = runs * params->ith / params->nth * R;
        const int64_t last = runs * (params->ith + 1) / params->nth * R;
        const q8_0_operand * act[4];
        const float * sums[4];
        float * out[4];
        for (int64_t r0 = first; r0 < last; r0 += R) {
            const char * xr = (const char *) x->data + r0 * x->nb[1];
            for (int64_t g0 = 0; g0 < m; g0 += 4) {
                const int G = (int) std::min<int64_t>(4, m - g0);
                for (int g = 0; g < G; ++g) {
                    act[g] = acts + (g0 + g) * blocks;
                    sums[g] = block_sums + (g0 + g) * blocks;
                    out[g] = (float *) ((char *) op->data + (g0 + g) * op->nb[1]) + r0;
                }
                if (m == 1) {
                    tile<W, 1, 1>(blocks, xr, x->nb[1], act, sums, out);
                } else {
                    tile<W, 4>(G, blocks, xr, x->nb[1], act, sums, out);
                }
            }
        }
        return true;
    }
};

dflash2::op_kernel<rows_traits<q5_0>> q5_0_kernel{ "DFLASH2_Q5_0_ROWS" };
dflash2::op_kernel<rows_traits<q8_0>> q8_0_kernel{ "DFLASH2_Q8_0_ROWS" };
dflash2::op_kernel<rows_traits<q4_1>> q4_1_kernel{ "DFLASH2_Q4_1_ROWS" };
dflash2::op_kernel<rows_traits<q5_1>> q5_1_kernel{ "DFLASH2_Q5_1_ROWS" };

// Random W weights (with some weights at the ends of their range) times random activation rows
// (one of them all zeros), of the drafters' and targets' widths, through ggml's product and the
// kernel: 1 to 17 activation rows, 8 to 136 weight rows.
template <class W> int64_t differences(dflash2::op_kernel<rows_traits<W>> & kernel, std::mt19937 & rng, int n_threads) {
    int64_t differing = 0;
    for (int64_t width : { 32, 576, 896, 1536 })
        for (int64_t n : { 8, 136 })
            for (int64_t m : { 1, 2, 3, 4, 5, 8, 17 }) {
                ggml_init_params init = { size_t(16) << 20, nullptr, false };
                ggml_context * ctx = ggml_init(init);
                if (!ctx) {
                    return -3;
                }
                ggml_tensor * x = ggml_new_tensor_2d(ctx, W::type, width, n);
                dflash2::random_weights(rng, W::type, x->data, width, n);
                ggml_tensor * y = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, width, m);
                dflash2::random_rows(rng, y, 0);
                const int64_t d = kernel.differences(ctx, ggml_mul_mat(ctx, x, y), n_threads);
                ggml_free(ctx);
                if (d < 0) {
                    return d;
                }
                differing += d;
            }
    return differing;
}

// The same from a seed, for the C entry points: -3 on any error (no exception crosses them).
template <class W> int64_t seeded_differences(dflash2::op_kernel<rows_traits<W>> & kernel, uint32_t seed, int n_threads) {
    try {
        std::mt19937 rng(seed);
        return differences(kernel, rng, n_threads);
    } catch (...) {
        return -3;
    }
}

}  // namespace
#endif

extern "C" int32_t dflash2_set_q5_0_rows(bool on) {
#if DFLASH2_QUANT_ROWS
    return q5_0_kernel.set(on);
#else
    (void) on;
    return -1;
#endif
}

extern "C" int32_t dflash2_set_q8_0_rows(bool on) {
#if DFLASH2_QUANT_ROWS
    return q8_0_kernel.set(on);
#else
    (void) on;
    return -1;
#endif
}

extern "C" int32_t dflash2_set_q4_1_rows(bool on) {
#if DFLASH2_QUANT_ROWS
    const int32_t q4_1 = q4_1_kernel.set(on), q5_1 = q5_1_kernel.set(on);
    return q4_1 == q5_1 ? q4_1 : 0;
#else
    (void) on;
    return -1;
#endif
}

extern "C" int64_t dflash2_q4_1_rows_differences(uint32_t seed, int32_t n_threads) {
#if DFLASH2_QUANT_ROWS
    const int64_t q4_1 = seeded_differences(q4_1_kernel, seed, n_threads);
    const int64_t q5_1 = seeded_differences(q5_1_kernel, seed, n_threads);
    return q4_1 < 0 ? q4_1 : q5_1 < 0 ? q5_1 : q4_1 + q5_1;
#else
    (void) seed, (void) n_threads;
    return -1;
#endif
}

extern "C" int64_t dflash2_q5_0_rows_differences(uint32_t seed, int32_t n_threads) {
#if DFLASH2_QUANT_ROWS
    return seeded_differences(q5_0_kernel, seed, n_threads);
#else
    (void) seed, (void) n_threads;
    return -1;
#endif
}

extern "C" int64_t dflash2_q8_0_rows_differences(uint32_t seed, int32_t n_threads) {
#if DFLASH2_QUANT_ROWS
    return seeded_differences(q8_0_kernel, seed, n_threads);
#else
    (void) seed, (void) n_threads;
    return -1;
#endif
}
