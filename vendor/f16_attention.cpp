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
// changes: a cache row is loaded and converted once for up to six queries that read it (the query
// heads of a GQA group, the rows of a verify batch), in registers; rows go in blocks that stay in
// cache while a prompt's many queries meet them; and the queries are converted once per product.
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
            float * dst[MAX_GROUP];
            for (int64_t c0 = 0; c0 < per_row; c0 += MAX_GROUP) {
                const int G = (int) std::min<int64_t>(MAX_GROUP, per_row - c0);
                for (int64_t t = t0; t < t1; ++t) {
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

dflash2::op_kernel<f16_attention_traits> kernel;

}  // namespace
#endif

extern "C" int32_t dflash2_set_f16_attention(bool on) {
#if DFLASH2_F16_ATTENTION
    return kernel.set(on, "DFLASH2_F16_ATTENTION");
#else
    (void) on;
    return -1;
#endif
}
