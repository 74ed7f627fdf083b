// Flash attention over a q8_0 KV cache (the DFlash drafter's).
//
// ggml's CPU flash attention over a quantized cache (ggml_compute_forward_flash_attn_ext_f16_one_chunk)
// runs one query row at a time through every cached cell: a call to ggml_vec_dot_q8_0_q8_0 for the
// score, the online softmax's expf, a call that dequantizes the cell's V row into a buffer, and a
// multiply-add of it into the row's accumulator. The queries of a GQA group and of a block all read
// the same cells, so each V row is dequantized again for every one of them (24 times in SmolLM2's
// drafter at a block of 8); at a block of 8 this attention was a quarter of a drafter call on a 2-core
// Xeon (BENCHMARKS.md (o)).
//
// This kernel gives every output the value ggml's gives it: the queries quantized by ggml's own
// quantize_row_q8_0; each score as ggml's AVX2 dot product computes it (exact integer lane sums of 4,
// here the unsigned K + 128 times the query counted from -128 times the query's lane sums, times the
// product of the two block scales, fused multiply-adds in block order from zero, hsum_float_8), then
// times the scale, plus the mask; the online softmax in the cells' order with the same expf, the
// accumulator scaled by the same factors, the same dequantized V values (quant times scale) in the same
// fused multiply-adds, the sum as a fused S * ms + vs; and the same final division. What changes: the
// V rows of the cells that the rows of a KV head read are widened once for all of them; each row then
// takes its scores and the softmax's steps in a first pass (no call per cell but expf) and its
// accumulator, in registers, in a second. It plugs in as one of ggml's CPU "extra buffer types"
// (vendor/cpu_extra.h) and takes flash attention with q8_0 K and V, f32 queries, an f16 mask or none,
// no sinks, ALiBi or soft-capping.
//
// Built for AVX-512 CPUs with VNNI (where ggml's q8_0 dot product is its AVX2 one) in the same
// `-march=native` build as llama.cpp; elsewhere dflash2_set_q8_0_attention() reports that it is not
// built.

#include "dflash2_shim.h"
#include "cpu_extra.h"

#include "ggml-backend.h"
#include "ggml-cpu.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__) && defined(__F16C__)
#define DFLASH2_Q8_0_ATTENTION 1
#include "ggml-cpu/quants.h"  // quantize_row_q8_0 (ggml's quantizer for the queries), the block types
#include <immintrin.h>
#else
#define DFLASH2_Q8_0_ATTENTION 0
#endif

#if DFLASH2_Q8_0_ATTENTION
namespace {

constexpr int QK = 32;

// The head sizes taken: whole q8_0 blocks, and an accumulator of at most 16 registers.
constexpr int64_t MAX_HEAD = 256;

// The most query rows (of one KV head) that go through the cells together.
constexpr int64_t MAX_ROWS = 32;

// A query block as the kernel reads it (K is Q8_0: made unsigned by 128).
using query_block = dflash2::q8_0_operand;

// The per-row buffers of one pass: the cells a row reads and the online softmax's factors there.
struct softmax_steps {
    std::vector<int32_t> cell;
    std::vector<float> ms, vs;
};

// One query row through the cells, as ggml's one_chunk runs it, in two passes: first the scores
// and the online softmax's scalar steps in the cells' order (its expf calls, ms and vs), then the
// accumulator (ggml's VKQ32) over the same cells in NV registers of 16 floats with the same
// multiplies and fused multiply-adds, the V rows already dequantized (v: `head` floats per cell).
template <int NV>
void attend(const query_block * q, int64_t blocks, const ggml_fp16_t * mask, int64_t cells, const char * k_base,
            size_t k_stride, const float * v, float scale, softmax_steps & steps, float * out) {
    float m = -INFINITY, sum = 0.0f;
    int64_t n = 0;
    for (int64_t ic = 0; ic < cells; ++ic) {
        const float mv = mask ? _cvtsh_ss(mask[ic]) : 0.0f;
        if (mv == -INFINITY) {
            continue;
        }
        const block_q8_0 * kc = (const block_q8_0 *) (k_base + ic * k_stride);
        __m256 dot = _mm256_setzero_ps();
        for (int64_t b = 0; b < blocks; ++b) {
            dot = dflash2::q8_0_dot_step(dot, dflash2::unsigned_q8_0(kc[b]), _mm256_set1_ps(_cvtsh_ss(kc[b].d)), q[b]);
        }
        // ggml rounds the scaled score before adding the mask (no fused multiply-add)
        float s = dflash2::hsum_float_8(dot) * scale;
        asm("" : "+x"(s));
        s += mv;
        float ms = 1.0f, vs = 1.0f;
        if (s > m) {
            ms = expf(m - s);
            m = s;
        } else {
            vs = expf(s - m);
        }
        sum = std::fma(sum, ms, vs);
        steps.cell[n] = (int32_t) ic;
        steps.ms[n] = ms;
        steps.vs[n] = vs;
        ++n;
    }
    __m512 acc[NV];
    for (int j = 0; j < NV; ++j) acc[j] = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; ++i) {
        if (steps.ms[i] != 1.0f) {
            // a new maximum (a factor of exactly 1 leaves the accumulator as it is)
            const __m512 f = _mm512_set1_ps(steps.ms[i]);
            for (int j = 0; j < NV; ++j) acc[j] = _mm512_mul_ps(acc[j], f);
        }
        const __m512 f = _mm512_set1_ps(steps.vs[i]);
        const float * vc = v + int64_t(steps.cell[i]) * NV * 16;
        for (int j = 0; j < NV; ++j) acc[j] = _mm512_fmadd_ps(_mm512_loadu_ps(vc + 16 * j), f, acc[j]);
    }
    const __m512 f = _mm512_set1_ps(sum == 0.0f ? 0.0f : 1.0f / sum);
    for (int j = 0; j < NV; ++j) _mm512_storeu_ps(out + 16 * j, _mm512_mul_ps(acc[j], f));
}

// attend<NV> by head size over 16 (head sizes are whole q8_0 blocks up to MAX_HEAD: even NV).
constexpr decltype(&attend<2>) ATTEND[MAX_HEAD / 16 + 1] = {
    nullptr, nullptr, attend<2>, nullptr, attend<4>, nullptr, attend<6>, nullptr, attend<8>,
    nullptr, attend<10>, nullptr, attend<12>, nullptr, attend<14>, nullptr, attend<16>,
};

class q8_0_attention_traits : public ggml::cpu::tensor_traits {
  public:
    static bool takes(const ggml_tensor * op) {
        if (op->op != GGML_OP_FLASH_ATTN_EXT) {
            return false;
        }
        const ggml_tensor * q = op->src[0];
        const ggml_tensor * k = op->src[1];
        const ggml_tensor * v = op->src[2];
        const ggml_tensor * mask = op->src[3];
        float max_bias, softcap;
        std::memcpy(&max_bias, (const float *) op->op_params + 1, sizeof(float));
        std::memcpy(&softcap, (const float *) op->op_params + 2, sizeof(float));
        return q && k && v && q->type == GGML_TYPE_F32 && k->type == GGML_TYPE_Q8_0 && v->type == GGML_TYPE_Q8_0 &&
               op->type == GGML_TYPE_F32 && (!mask || mask->type == GGML_TYPE_F16) && !op->src[4] && max_bias == 0.0f &&
               softcap == 0.0f && k->ne[0] == v->ne[0] && k->ne[0] % QK == 0 && k->ne[0] <= MAX_HEAD &&
               k->ne[2] == v->ne[2] && k->ne[3] == v->ne[3] && q->ne[2] % k->ne[2] == 0 && q->ne[3] % k->ne[3] == 0 &&
               q->ne[2] / k->ne[2] <= MAX_ROWS && q->nb[0] == sizeof(float) && op->nb[0] == sizeof(float) &&
               k->nb[0] == ggml_type_size(k->type) && v->nb[0] == ggml_type_size(v->type);
    }

    // No buffer from ggml: ggml's own sizing stays, so that it can always take the op back.
    bool work_size(int, const ggml_tensor *, size_t &) override { return false; }

    bool compute_forward(ggml_compute_params * params, ggml_tensor * op) override {
        if (params->use_ref) {
            return false;  // the reference kernels were asked for
        }
        const ggml_tensor * q = op->src[0];
        const ggml_tensor * k = op->src[1];
        const ggml_tensor * v = op->src[2];
        const ggml_tensor * mask = op->src[3];
        float scale;
        std::memcpy(&scale, op->op_params, sizeof(float));

        const int64_t head = k->ne[0], blocks = head / QK;
        const int64_t n_tokens = q->ne[1], q_heads = q->ne[2], q_outer = q->ne[3];
        const int64_t kv_heads = k->ne[2], cells = k->ne[1];
        const int64_t group = q_heads / kv_heads, outer_ratio = q_outer / k->ne[3];

        // Work units: the query rows of one KV head, a run of tokens at a time; at least two units
        // per thread where there are tokens enough, so that the threads finish together.
        const int64_t heads_total = q_outer * kv_heads;
        const int64_t wanted_runs = std::min(n_tokens, (2 * params->nth + heads_total - 1) / heads_total);
        const int64_t tokens_per_unit =
            std::max<int64_t>(1, std::min((n_tokens + wanted_runs - 1) / wanted_runs, MAX_ROWS / group));
        const int64_t runs = (n_tokens + tokens_per_unit - 1) / tokens_per_unit;
        const int64_t units = heads_total * runs;

        thread_local std::vector<query_block> queries;
        thread_local std::vector<block_q8_0> quantized;
        thread_local std::vector<float> values;
        thread_local std::vector<char> read;
        thread_local softmax_steps steps;
        queries.resize(size_t(MAX_ROWS * blocks));
        quantized.resize(size_t(blocks));
        values.resize(size_t(cells * head));
        read.resize(size_t(cells));
        steps.cell.resize(size_t(cells));
        steps.ms.resize(size_t(cells));
        steps.vs.resize(size_t(cells));
        const ggml_fp16_t * masks[MAX_ROWS];
        float * outs[MAX_ROWS];
        const auto attend_row = ATTEND[head / 16];

        for (int64_t u = params->ith; u < units; u += params->nth) {
            const int64_t run = u % runs, ik2 = (u / runs) % kv_heads, iq3 = u / (runs * kv_heads);
            const int64_t ik3 = iq3 / outer_ratio;
            const int64_t t0 = run * tokens_per_unit, t1 = std::min(n_tokens, t0 + tokens_per_unit);
            int n = 0;
            for (int64_t iq1 = t0; iq1 < t1; ++iq1) {
                for (int64_t iq2 = ik2 * group; iq2 < (ik2 + 1) * group; ++iq2, ++n) {
                    const float * pq = (const float *) ((const char *) q->data + iq1 * q->nb[1] + iq2 * q->nb[2] + iq3 * q->nb[3]);
                    dflash2::q8_0_operands<7>(pq, head, quantized.data(), queries.data() + n * blocks);
                    masks[n] = mask ? (const ggml_fp16_t *) ((const char *) mask->data + iq1 * mask->nb[1] +
                                                             (iq2 % mask->ne[2]) * mask->nb[2] + (iq3 % mask->ne[3]) * mask->nb[3])
                                    : nullptr;
                    // permute(0, 2, 1, 3), as ggml writes it
                    outs[n] = (float *) ((char *) op->data + (iq3 * op->ne[2] * op->ne[1] + iq2 + iq1 * op->ne[1]) * op->nb[1]);
                }
            }
            // V of every cell some row reads, dequantized once (as ggml's dequantize_row_q8_0: quant times scale)
            std::fill(read.begin(), read.end(), char(mask == nullptr));
            for (int i = 0; mask && i < n; ++i) {
                // -inf is one f16 pattern; 32 cells at a time
                const uint16_t * bits = (const uint16_t *) masks[i];
                int64_t ic = 0;
                for (; ic + 32 <= cells; ic += 32) {
                    const __mmask32 live = _mm512_cmpneq_epi16_mask(_mm512_loadu_si512(bits + ic), _mm512_set1_epi16((short) 0xFC00));
                    if (live) {
                        for (int j = 0; j < 32; ++j) read[ic + j] |= (live >> j) & 1;
                    }
                }
                for (; ic < cells; ++ic) read[ic] |= bits[ic] != 0xFC00;
            }
            const char * k_base = (const char *) k->data + ik2 * k->nb[2] + ik3 * k->nb[3];
            const char * v_base = (const char *) v->data + ik2 * v->nb[2] + ik3 * v->nb[3];
            for (int64_t ic = 0; ic < cells; ++ic) {
                if (!read[ic]) {
                    continue;
                }
                const block_q8_0 * vc = (const block_q8_0 *) (v_base + ic * v->nb[1]);
                float * to = values.data() + ic * head;
                for (int64_t b = 0; b < blocks; ++b) {
                    const __m512 d = _mm512_set1_ps(_cvtsh_ss(vc[b].d));
                    const __m128i lo = _mm_loadu_si128((const __m128i *) vc[b].qs);
                    const __m128i hi = _mm_loadu_si128((const __m128i *) vc[b].qs + 1);
                    _mm512_storeu_ps(to + b * QK, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo)), d));
                    _mm512_storeu_ps(to + b * QK + 16, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi)), d));
                }
            }
            for (int i = 0; i < n; ++i) {
                attend_row(queries.data() + i * blocks, blocks, masks[i], cells, k_base, k->nb[1], values.data(), scale, steps, outs[i]);
            }
        }
        return true;
    }
};

dflash2::op_kernel<q8_0_attention_traits> kernel{ "DFLASH2_Q8_0_ATTENTION" };

// Random q8_0 K and V of n_cells cells (laid out as a cache: heads inside cells), queries laid out
// as llama.cpp's (heads inside tokens), a mask of zeros, -inf and small biases (with one token
// masked everywhere), through ggml's flash attention and through the kernel.
int64_t differences(int head, int n_tokens, int n_heads, int n_kv_heads, int n_cells, std::mt19937 & rng, int n_threads) {
    ggml_init_params init = { size_t(64) << 20, nullptr, false };
    ggml_context * ctx = ggml_init(init);
    if (!ctx) {
        return -3;
    }
    std::uniform_real_distribution<float> uniform(-2.0f, 2.0f);
    auto random_q8_0 = [&](int64_t rows, int64_t heads) {
        ggml_tensor * t = ggml_new_tensor_3d(ctx, GGML_TYPE_Q8_0, head, heads, rows);
        std::vector<float> values(size_t(head * heads * rows));
        for (float & x : values) x = uniform(rng);
        ggml_quantize_chunk(GGML_TYPE_Q8_0, values.data(), t->data, 0, heads * rows, head, nullptr);
        return ggml_permute(ctx, t, 0, 2, 1, 3);  // [head, cells, heads]
    };
    ggml_tensor * q = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, head, n_heads, n_tokens);
    for (int64_t i = 0; i < ggml_nelements(q); ++i) ((float *) q->data)[i] = uniform(rng);
    ggml_tensor * k = random_q8_0(n_cells, n_kv_heads);
    ggml_tensor * v = random_q8_0(n_cells, n_kv_heads);
    ggml_tensor * mask = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, n_cells, n_tokens);
    for (int t = 0; t < n_tokens; ++t) {
        for (int c = 0; c < n_cells; ++c) {
            const uint32_t r = rng() % 8;
            const float m = (t == n_tokens / 2 && n_tokens > 1) || r == 0 ? -INFINITY : r == 1 ? -uniform(rng) * uniform(rng) : 0.0f;
            ((ggml_fp16_t *) mask->data)[size_t(t) * n_cells + c] = ggml_fp32_to_fp16(m);
        }
    }
    ggml_tensor * out = ggml_flash_attn_ext(ctx, ggml_permute(ctx, q, 0, 2, 1, 3), k, v, mask, 1.0f / std::sqrt(float(head)), 0.0f, 0.0f);
    const int64_t differing = kernel.differences(ctx, out, n_threads);
    ggml_free(ctx);
    return differing;
}

}  // namespace
#endif

extern "C" int32_t dflash2_set_q8_0_attention(bool on) {
#if DFLASH2_Q8_0_ATTENTION
    return kernel.set(on);
#else
    (void) on;
    return -1;
#endif
}

extern "C" int64_t dflash2_q8_0_attention_differences(uint32_t seed, int32_t n_threads) {
#if DFLASH2_Q8_0_ATTENTION
    try {
        // head sizes of 64 and 128; GQA groups of 3 (SmolLM2's), 1, 8 and 2; a single token to 40
        // (several passes of up to 32 rows per KV head); 1 to 700 cells
        std::mt19937 rng(seed);
        int64_t differing = 0;
        for (int head : { 64, 128 })
            for (auto heads : { std::make_pair(9, 3), std::make_pair(4, 4), std::make_pair(8, 1), std::make_pair(2, 1) })
                for (int tokens : { 1, 2, 7, 16, 40 })
                    for (int cells : { 1, 37, 264, 700 }) {
                        const int64_t d = differences(head, tokens, heads.first, heads.second, cells, rng, n_threads);
                        if (d < 0) {
                            return d;
                        }
                        differing += d;
                    }
        return differing;
    } catch (...) {
        return -3;
    }
#else
    (void) seed, (void) n_threads;
    return -1;
#endif
}
