// Products of Q5_0 weights with activation rows.
//
// ggml has neither a repacked nor an AMX kernel for Q5_0, the type that K-quant files fall back to
// for weights whose width is no multiple of 256 (most of Qwen2.5-0.5B's Q4_K_M). It multiplies them
// by calling ggml_vec_dot_q5_0_q8_0 once per (weight row, activation row): per 32-wide block it
// unpacks the 5-bit weights to signed bytes, takes their integer dot products with the activations'
// q8_0 block in 8 lanes of 4, and adds them, times the two blocks' scales, into 8 float accumulators
// (fused multiply-adds in block order), reduced at the end as hsum_float_8. On a 2-core Xeon that
// is 57% of a Qwen2.5-Coder-0.5B step, streaming its weights at a quarter of the rate the Q8_0 head
// reaches (BENCHMARKS.md (n)).
//
// This kernel gives every output the value ggml's gives it: the same exact integer lane sums (here
// the unsigned 5-bit weights times the activations, counted from -16 times the activations' lane
// sums, which is ggml's signed product), the same scale product, the same chain of fused
// multiply-adds in block order, the same reduction. What changes: each weight block is unpacked
// once for up to four activation rows, the activations' scales and lane sums are prepared once per
// product, and eight (one activation row) or four weight rows run side by side, so that their
// chains overlap. It plugs in as one of ggml's CPU "extra buffer types" (vendor/cpu_extra.h) and
// takes 2-D products of Q5_0 weights in host memory by f32 activations.
//
// Built for AVX-512 CPUs with VNNI (where ggml's Q5_0 dot product is its AVX2 one) in the same
// `-march=native` build as llama.cpp; elsewhere dflash2_set_q5_0_rows() reports that it is not built.

#include "dflash2_shim.h"
#include "cpu_extra.h"

#include "ggml-backend.h"

#include <algorithm>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__) && defined(__F16C__)
#define DFLASH2_Q5_0_ROWS 1
#include "ggml-cpu/quants.h"  // quantize_row_q8_0 (ggml's quantizer for the activations), the block types
#include <immintrin.h>
#else
#define DFLASH2_Q5_0_ROWS 0
#endif

#if DFLASH2_Q5_0_ROWS
namespace {

constexpr int QK = 32;

// An activation block as this kernel reads it: the quants of ggml's q8_0 block, its scale widened
// to f32, and -16 times the sums of its 8 lanes of 4 quants.
struct act_block {
    int32_t neg_sum16[8];
    int8_t qs[QK];
    float d;
};

// The largest work buffer the kernel asks for (a prompt batch is the most); beyond, ggml's own.
constexpr size_t MAX_WORK = size_t(64) << 20;

inline size_t work_for(int64_t rows, int64_t blocks) { return size_t(rows * blocks) * (sizeof(act_block) + sizeof(block_q8_0)); }

// A Q5_0 block's 32 weights as unsigned bytes w + 16 (0..31), in ggml's order: the low nibbles of
// qs are weights 0..15, the high nibbles 16..31, bit k of qh is weight k's fifth bit.
inline __m256i unpack(const block_q5_0 & b) {
    __m256i bytes = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *) b.qs));
    bytes = _mm256_srlv_epi64(bytes, _mm256_set_epi64x(4, 4, 0, 0));
    bytes = _mm256_and_si256(bytes, _mm256_set1_epi8(0x0F));
    uint32_t qh;
    std::memcpy(&qh, b.qh, sizeof(qh));
    return _mm256_mask_add_epi8(bytes, (__mmask32) qh, bytes, _mm256_set1_epi8(16));
}

// R weight rows (x, stride `stride` bytes) times G activation rows, each output as
// ggml_vec_dot_q5_0_q8_0 computes it; out[g][r] receives row r's product with activation row g.
template <int R, int G>
inline void tile(int64_t blocks, const char * x, size_t stride, const act_block * const * act, float * const * out) {
    __m256 acc[R][G];
    for (int r = 0; r < R; ++r)
        for (int g = 0; g < G; ++g) acc[r][g] = _mm256_setzero_ps();
    for (int64_t ib = 0; ib < blocks; ++ib) {
        for (int r = 0; r < R; ++r) {
            const block_q5_0 & b = ((const block_q5_0 *) (x + r * stride))[ib];
            const __m256i w = unpack(b);
            const float xd = _cvtsh_ss(b.d);
            for (int g = 0; g < G; ++g) {
                const act_block & a = act[g][ib];
                // exact: sum over 4 of (w + 16) * y, counted from -16 * sum of y
                const __m256i dot = _mm256_dpbusd_epi32(_mm256_loadu_si256((const __m256i *) a.neg_sum16), w,
                                                        _mm256_loadu_si256((const __m256i *) a.qs));
                const __m256 d = _mm256_set1_ps(xd * a.d);
                acc[r][g] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(dot), acc[r][g]);
            }
        }
    }
    for (int r = 0; r < R; ++r)
        for (int g = 0; g < G; ++g) out[g][r] = dflash2::hsum_float_8(acc[r][g]);
}

template <int R>
inline void tile(int G, int64_t blocks, const char * x, size_t stride, const act_block * const * act, float * const * out) {
    switch (G) {
        case 1: tile<R, 1>(blocks, x, stride, act, out); break;
        case 2: tile<R, 2>(blocks, x, stride, act, out); break;
        case 3: tile<R, 3>(blocks, x, stride, act, out); break;
        default: tile<R, 4>(blocks, x, stride, act, out); break;
    }
}

class q5_0_rows_traits : public ggml::cpu::tensor_traits {
  public:
    // A 2-D Q5_0 weight of rows a multiple of 8 (whole runs; real models' are) in host memory
    // (ggml's plain CPU buffer: nothing repacks Q5_0) by 2-D f32 activations, into f32.
    static bool takes(const ggml_tensor * op) {
        const ggml_tensor * x = op->src[0];
        const ggml_tensor * y = op->src[1];
        return op->op == GGML_OP_MUL_MAT && x && y && x->type == GGML_TYPE_Q5_0 && y->type == GGML_TYPE_F32 &&
               op->type == GGML_TYPE_F32 && x->ne[0] % QK == 0 && x->ne[1] % 8 == 0 && x->ne[2] == 1 && x->ne[3] == 1 && y->ne[2] == 1 &&
               y->ne[3] == 1 && x->nb[0] == sizeof(block_q5_0) && y->nb[0] == sizeof(float) && op->nb[0] == sizeof(float) &&
               work_for(y->ne[1], x->ne[0] / QK) <= MAX_WORK && x->buffer && !x->extra &&
               ggml_backend_buffer_is_host(x->buffer);
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
        act_block * acts = static_cast<act_block *>(params->wdata);
        block_q8_0 * quants = reinterpret_cast<block_q8_0 *>(acts + m * blocks);

        // Every activation row quantized as ggml quantizes it, split between the threads.
        const __m256i ones = _mm256_set1_epi8(1);
        for (int64_t i = params->ith; i < m; i += params->nth) {
            block_q8_0 * q = quants + i * blocks;
            quantize_row_q8_0((const float *) ((const char *) y->data + i * y->nb[1]), q, k);
            for (int64_t ib = 0; ib < blocks; ++ib) {
                act_block & a = acts[i * blocks + ib];
                const __m256i qs = _mm256_loadu_si256((const __m256i *) q[ib].qs);
                const __m256i sums = _mm256_dpbusd_epi32(_mm256_setzero_si256(), ones, qs);
                _mm256_storeu_si256((__m256i *) a.neg_sum16, _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(sums, 4)));
                std::memcpy(a.qs, q[ib].qs, QK);
                a.d = _cvtsh_ss(q[ib].d);
            }
        }
        ggml_barrier(params->threadpool);

        // The weight rows, split between the threads in runs of R: eight side by side for one
        // activation row, four for more (each then meets the activation rows four at a time).
        const int R = m == 1 ? 8 : 4;
        const int64_t runs = (n + R - 1) / R;
        const int64_t first = runs * params->ith / params->nth * R;
        const int64_t last = runs * (params->ith + 1) / params->nth * R;
        const act_block * act[4];
        float * out[4];
        for (int64_t r0 = first; r0 < last; r0 += R) {
            const char * xr = (const char *) x->data + r0 * x->nb[1];
            for (int64_t g0 = 0; g0 < m; g0 += 4) {
                const int G = (int) std::min<int64_t>(4, m - g0);
                for (int g = 0; g < G; ++g) {
                    act[g] = acts + (g0 + g) * blocks;
                    out[g] = (float *) ((char *) op->data + (g0 + g) * op->nb[1]) + r0;
                }
                if (R == 8) {
                    tile<8>(G, blocks, xr, x->nb[1], act, out);
                } else {
                    tile<4>(G, blocks, xr, x->nb[1], act, out);
                }
            }
        }
        return true;
    }
};

dflash2::op_kernel<q5_0_rows_traits> kernel{ "DFLASH2_Q5_0_ROWS" };

}  // namespace
#endif

extern "C" int32_t dflash2_set_q5_0_rows(bool on) {
#if DFLASH2_Q5_0_ROWS
    return kernel.set(on);
#else
    (void) on;
    return -1;
#endif
}
