// Attention products over an f16 KV cache.
//
// Without flash attention llama.cpp computes attention as two matrix products over the cache: the
// scores K x q and the mix V^T x softmax. With an f16 cache ggml multiplies them by calling
// ggml_vec_dot_f16 once per (cache cell, query) pair: for a head size of 64 that is one 64-long
// dot product per call, each converting its 64 cache values and 64 query values to f32 again,
// keeping its four accumulators on the stack and reducing them alone. At 400 tokens of context
// these calls are 40% of a SmolLM2 decoding step on a 2-core Xeon (BENCHMARKS.md (m)).
//
// This kernel computes the same products the way ggml_vec_dot_f16 computes each element (AVX-512:
// four 16-wide f32 accumulators fed by fused multiply-adds over 64-wide steps, reduced as
// (a0 + a2) + (a1 + a3) and then across lanes, summed in double and stored as float), so every
// output keeps its bits, and the queries keep the values ggml gives them (rounded to f16). What
// changes: a cache row is loaded and converted once for the queries that read it (the query heads
// of a GQA group, the rows of a verify batch); rows go in blocks that stay in cache while a
// prompt's many queries meet them; the queries are converted once per product; and the scores'
// short sums reduce sixteen at a time, in the same tree.
// It plugs in as one of ggml's CPU "extra buffer types" (vendor/cpu_extra.h); it takes f16 x f32
// products whose queries fit MAX_WORK and leaves every other op to ggml.
//
// Built for AVX-512 CPUs (where ggml's f16 dot product is the one above) in the same
// `-march=native` build as llama.cpp; elsewhere dflash2_set_f16_attention() reports that it is not
// built.

#include "dflash2_shim.h"
#include "cpu_extra.h"

#include "ggml-backend.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__F16C__)
#define DFLASH2_F16_ATTENTION 1
#include <immintrin.h>
#else
#define DFLASH2_F16_ATTENTION 0
#endif

#if DFLASH2_F16_ATTENTION
namespace {

// ggml's AVX-512 f16 dot product steps over 64 elements with 4 accumulators of 16 lanes.
constexpr int STEP = 64;
constexpr int LANES = 16;

// The largest work buffer this kernel asks for: its queries are f32 (twice ggml's f16), so the
// mix of a long prompt batch over a long cache goes to ggml instead.
constexpr size_t MAX_WORK = size_t(32) << 20;

// The most queries one pass over a cache row serves: 4 accumulators each, plus the 4 converted
// cache vectors, within the 32 registers.
constexpr int MAX_GROUP = 6;

// Dot products of one f16 row x (n elements, n a multiple of STEP) with G f32 rows y[g] (the
// queries, already rounded through f16), each computed as ggml_vec_dot_f16 computes it.
template <int G>
inline void row_dots(int n, const ggml_fp16_t * x, const float * const * y, float * const * out) {
    __m512 acc[G][4];
    for (int g = 0; g < G; ++g)
        for (int j = 0; j < 4; ++j) acc[g][j] = _mm512_setzero_ps();
    for (int i = 0; i < n; i += STEP) {
        __m512 xv[4];
        for (int j = 0; j < 4; ++j) xv[j] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) (x + i + j * LANES)));
        for (int g = 0; g < G; ++g)
            for (int j = 0; j < 4; ++j)
                acc[g][j] = _mm512_fmadd_ps(xv[j], _mm512_loadu_ps(y[g] + i + j * LANES), acc[g][j]);
    }
    for (int g = 0; g < G; ++g) {
        const __m512 a02 = _mm512_add_ps(acc[g][0], acc[g][2]);
        const __m512 a13 = _mm512_add_ps(acc[g][1], acc[g][3]);
        const double sum = (double) _mm512_reduce_add_ps(_mm512_add_ps(a02, a13));
        *out[g] = (float) sum;
    }
}

inline void row_dots(int G, int n, const ggml_fp16_t * x, const float * const * y, float * const * out) {
    switch (G) {
        case 1: row_dots<1>(n, x, y, out); break;
        case 2: row_dots<2>(n, x, y, out); break;
        case 3: row_dots<3>(n, x, y, out); break;
        case 4: row_dots<4>(n, x, y, out); break;
        case 5: row_dots<5>(n, x, y, out); break;
        default: row_dots<6>(n, x, y, out); break;
    }
}

// The scores' short rows (a head of 64 or 128 values: one or two steps) leave most of a row's cost
// to the lane reduction, 7 operations for each output. Sixteen outputs reduce together here, by
// transposing as they add: the 256-bit halves, the 128-bit halves, lanes {0, 1} + {2, 3}, then
// lane 0 + 1, the tree GCC's _mm512_reduce_add_ps adds in (45 operations for the 16). A tree of
// another compiler's would differ: transposed_reduction_is_ggmls() checks it once, and the scores
// keep row_dots where it does not hold.
constexpr int BLOCK = 16;
constexpr int MAX_SHORT_STEPS = 2;

// Lane i of the result: v[tau(i)] reduced, tau(i) = 4 * (i % 4) + i / 4 (the order the four
// levels leave the sums in; callers lay their rows out so).
inline __m512 reduce16(const __m512 v[BLOCK]) {
    __m512 w[8], z[4], y[2];
    for (int i = 0; i < 8; ++i)  // lanes i + 8 and i of each
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE), _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44));
    for (int i = 0; i < 4; ++i)  // then lanes j + 4 and j
        z[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xDD), _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88));
    for (int i = 0; i < 2; ++i)  // then lanes {0, 1} and {2, 3}
        y[i] = _mm512_add_ps(_mm512_shuffle_ps(z[2 * i], z[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(z[2 * i], z[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    // then lane 0 and 1
    return _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_ps(y[0], y[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

constexpr int tau(int i) { return 4 * (i % 4) + i / 4; }

// Whether reduce16 adds as this compiler's _mm512_reduce_add_ps (which ggml's dot product calls)
// does, on values of every sign and of exponents far apart (so that any other order rounds
// differently somewhere).
bool transposed_reduction_is_ggmls() {
    uint64_t state = 0x9E3779B97F4A7C15ull;
    auto next = [&] {
        state ^= state << 13, state ^= state >> 7, state ^= state << 17;
        return state;
    };
    for (int round = 0; round < 256; ++round) {
        alignas(64) float values[BLOCK][LANES];
        for (auto & row : values)
            for (float & x : row) {
                const uint64_t r = next();
                x = std::ldexp(float(r & 0xFFFFFF) / float(1 << 24), int((r >> 24) % 40) - 20) * ((r >> 40) & 1 ? -1.0f : 1.0f);
            }
        __m512 v[BLOCK];
        for (int i = 0; i < BLOCK; ++i) v[i] = _mm512_load_ps(values[tau(i)]);
        alignas(64) float sums[BLOCK];
        _mm512_store_ps(sums, reduce16(v));
        for (int i = 0; i < BLOCK; ++i) {
            const float ggml = _mm512_reduce_add_ps(_mm512_load_ps(values[i]));
            if (std::memcmp(&ggml, &sums[i], sizeof(float)) != 0) {
                return false;
            }
        }
    }
    return true;
}

// Dot products of BLOCK converted rows (xs: row tau(i) at i * STEPS * STEP) of STEPS steps with
// one query y, each as ggml_vec_dot_f16 computes it, in row order.
template <int STEPS> inline __m512 block_dots(const float * xs, const float * y) {
    __m512 yv[STEPS][4];
    for (int s = 0; s < STEPS; ++s)
        for (int j = 0; j < 4; ++j) yv[s][j] = _mm512_loadu_ps(y + s * STEP + j * LANES);
    __m512 sums[BLOCK];
    for (int i = 0; i < BLOCK; ++i) {
        const float * x = xs + i * STEPS * STEP;
        __m512 acc[4];
        for (int j = 0; j < 4; ++j) acc[j] = _mm512_setzero_ps();
        for (int s = 0; s < STEPS; ++s)
            for (int j = 0; j < 4; ++j) acc[j] = _mm512_fmadd_ps(_mm512_load_ps(x + s * STEP + j * LANES), yv[s][j], acc[j]);
        sums[i] = _mm512_add_ps(_mm512_add_ps(acc[0], acc[2]), _mm512_add_ps(acc[1], acc[3]));
    }
    return reduce16(sums);
}

// Queries as ggml hands them to its dot product: f32 rounded to f16 (to nearest even, as
// ggml_cpu_fp32_to_fp16 does), kept here widened back to f32 so that no pass converts them again.
inline void round_through_f16(const float * src, float * dst, int64_t n) {
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        const __m256i h = _mm512_cvtps_ph(_mm512_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT);
        _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(h));
    }
    for (; i < n; ++i) dst[i] = _cvtsh_ss(_cvtss_sh(src[i], _MM_FROUND_TO_NEAREST_INT));
}

class f16_attention_traits : public ggml::cpu::tensor_traits {
  public:
    // An f16 src0 (cache or weight) of rows a multiple of STEP long (ggml's scalar tail is not
    // reproduced), f32 queries within MAX_WORK, f32 output, every innermost dimension contiguous.
    static bool takes(const ggml_tensor * op) {
        const ggml_tensor * x = op->src[0];
        const ggml_tensor * y = op->src[1];
        return op->op == GGML_OP_MUL_MAT && x && y && x->type == GGML_TYPE_F16 && y->type == GGML_TYPE_F32 &&
               op->type == GGML_TYPE_F32 && x->ne[0] % STEP == 0 && size_t(ggml_nelements(y)) * sizeof(float) <= MAX_WORK &&
               x->nb[0] == sizeof(ggml_fp16_t) && y->nb[0] == sizeof(float) && op->nb[0] == sizeof(float) &&
               y->ne[2] % x->ne[2] == 0 && y->ne[3] % x->ne[3] == 0 && x->buffer && !x->extra &&
               ggml_backend_buffer_is_host(x->buffer);
    }

    // The queries, rounded through f16, as f32 (ggml's own buffer would hold them as f16).
    bool work_size(int, const ggml_tensor * op, size_t & size) override {
        size = ggml_nelements(op->src[1]) * sizeof(float);
        return true;
    }

    bool compute_forward(ggml_compute_params * params, ggml_tensor * op) override {
        if (params->use_ref) {
            return false;  // the reference kernels were asked for
        }
        const ggml_tensor * x = op->src[0];
        const ggml_tensor * y = op->src[1];
        const int64_t n = x->ne[0];
        const int64_t q_rows = y->ne[1], q_heads = y->ne[2], q_outer = y->ne[3];
        float * queries = static_cast<float *>(params->wdata);
        auto query = [&](int64_t i11, int64_t i12, int64_t i13) {
            return queries + ((i13 * q_heads + i12) * q_rows + i11) * n;
        };
        // Every query row, split between the threads; then one barrier.
        const int64_t n_queries = q_rows * q_heads * q_outer;
        for (int64_t r = params->ith; r < n_queries; r += params->nth) {
            const int64_t i11 = r % q_rows, i12 = (r / q_rows) % q_heads, i13 = r / (q_rows * q_heads);
            const float * src = (const float *) ((const char *) y->data + i11 * y->nb[1] + i12 * y->nb[2] + i13 * y->nb[3]);
            round_through_f16(src, query(i11, i12, i13), n);
        }
        ggml_barrier(params->threadpool);

        // The src0 rows (over its heads and outer dimension too), split evenly between the threads;
        // each row meets every query of the heads that share it (ggml's broadcast: q head i12
        // reads src0 head i12 / r2), listed once per head.
        const int64_t rows = x->ne[1], heads = x->ne[2];
        const int64_t r2 = q_heads / heads, r3 = q_outer / x->ne[3];
        const int64_t total = rows * heads * x->ne[3];
        const int64_t first = total * params->ith / params->nth;
        const int64_t last = total * (params->ith + 1) / params->nth;
        const int64_t per_row = r2 * r3 * q_rows;
        // rows of one or two steps (the scores over a head of 64 or 128) go in blocks
        static const bool blocks_add_as_ggml = transposed_reduction_is_ggmls();
        const bool short_rows = blocks_add_as_ggml && n <= MAX_SHORT_STEPS * STEP;
        thread_local std::vector<const float *> ys;
        thread_local std::vector<float *> outs;
        ys.resize(per_row);
        outs.resize(per_row);
        // Rows in blocks, so that a prompt's many queries meet a block of rows while it is in
        // cache; a verify's few queries are one group.
        constexpr int64_t ROW_BLOCK = 32;
        for (int64_t t0 = first; t0 < last;) {
            const int64_t head = t0 / rows;
            const int64_t t1 = std::min({ last, (head + 1) * rows, t0 + ROW_BLOCK });
            const int64_t i02 = head % heads, i03 = head / heads;
            if (t0 == first || t0 % rows == 0) {
                for (int64_t c = 0; c < per_row; ++c) {
                    const int64_t i11 = c % q_rows;
                    const int64_t i12 = i02 * r2 + (c / q_rows) % r2;
                    const int64_t i13 = i03 * r3 + c / (q_rows * r2);
                    ys[c] = query(i11, i12, i13);
                    outs[c] = (float *) ((char *) op->data + i11 * op->nb[1] + i12 * op->nb[2] + i13 * op->nb[3]);
                }
            }
            const char * base = (const char *) x->data + i02 * x->nb[2] + i03 * x->nb[3];
            int64_t rest = t0;
            if (short_rows) {
                // whole blocks of rows converted once, then every query against the block
                alignas(64) float xs[BLOCK * MAX_SHORT_STEPS * STEP];
                for (; rest + BLOCK <= t1; rest += BLOCK) {
                    const int64_t ir0 = rest % rows;
                    for (int i = 0; i < BLOCK; ++i) {
                        const auto * row = (const ggml_fp16_t *) (base + (ir0 + tau(i)) * x->nb[1]);
                        for (int64_t e = 0; e < n; e += LANES)
                            _mm512_store_ps(xs + i * n + e, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) (row + e))));
                    }
                    for (int64_t c = 0; c < per_row; ++c) {
                        _mm512_storeu_ps(outs[c] + ir0, n == STEP ? block_dots<1>(xs, ys[c]) : block_dots<2>(xs, ys[c]));
                    }
                }
            }
            float * dst[MAX_GROUP];
            for (int64_t c0 = 0; c0 < per_row; c0 += MAX_GROUP) {
                const int G = (int) std::min<int64_t>(MAX_GROUP, per_row - c0);
                for (int64_t t = rest; t < t1; ++t) {
                    const int64_t ir0 = t % rows;
                    for (int g = 0; g < G; ++g) dst[g] = outs[c0 + g] + ir0;
                    row_dots(G, (int) n, (const ggml_fp16_t *) (base + ir0 * x->nb[1]), ys.data() + c0, dst);
                }
            }
            t0 = t1;
        }
        return true;
    }
};

dflash2::op_kernel<f16_attention_traits> kernel{ "DFLASH2_F16_ATTENTION" };

}  // namespace
#endif

extern "C" int32_t dflash2_set_f16_attention(bool on) {
#if DFLASH2_F16_ATTENTION
    return kernel.set(on);
#else
    (void) on;
    return -1;
#endif
}
