// Products of K-quant weights (Q4_K, Q5_K, Q6_K) and IQ4_XS weights that ggml keeps unrepacked,
// with activation rows.
//
// On x86 without AMX, ggml repacks only Q4_K (and Q2_K) of the K-quants; the Q6_K tensors of every
// Q4_K_M and Q5_K_M file (the output head of Qwen2.5's tied-embedding files, ffn_down and attn_v of
// half the layers), all of Q5_K_M's Q5_K weights and IQ4_XS files' weights are multiplied by
// ggml_vec_dot_<type>_q8_K once per (weight row, activation row), over activations quantized by
// quantize_row_q8_K. Its AVX2 code takes each 256-weight superblock in 32-byte vectors: maddubs
// pairs, times the 16- or 32-weight group's scale (madd), summed into 8 int32 lanes, lane l holding
// the weights whose index mod 32 lies in [4l, 4l + 4) (Q6_K's lanes also take 32 times the scales by
// the activations' 16-wide sums of groups 2l and 2l + 1); per superblock the lanes go to float and
// into 8 float accumulators by one fused multiply-add with the two scales' product, reduced at the
// end by hsum_float_8; Q4_K and Q5_K then add their minimums' part, accumulated as ggml does it. On a
// 2-core EPYC it was 31% of a plain step of Qwen2.5-Coder-1.5B Q4_K_M, and a verify pays it once per
// row.
//
// This kernel gives every output that value: every lane's integer is exact in both (so equal), the
// float operations are ggml's, in its order. How the integers are counted changes: a 64-byte
// vector of unsigned weights meets the activations in one vpdpbusd (sums of 4 products, which fit
// 16 bits), and one vpdpwssd multiplies those sums by their group's scale into the lanes; a weight
// row's superblock is unpacked once for up to 8 activation rows. It plugs in as one of ggml's CPU
// "extra buffer types" (vendor/cpu_extra.h), one per weight type, and takes 2-D products of such
// weights in host memory by f32 activations, of any number of rows (a plain step's one included).
//
// Built for AVX-512 CPUs with VNNI (where ggml's dot products are its AVX2 ones) in the same
// `-march=native` build as llama.cpp; elsewhere dflash2_set_kquant_rows() reports that it is not
// built. (IQ4_XS's signed weights take their scale in 32 bits: see iq4_xs below.)

#include "dflash2_shim.h"
#include "cpu_extra.h"

#include "ggml-backend.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__) && defined(__F16C__)
#define DFLASH2_KQUANT_ROWS 1
#include "ggml-cpu/quants.h"  // quantize_row_q8_K (ggml's quantizer for the activations), the block types
#define GGML_COMMON_IMPL_CPP
#include "ggml-common.h"  // kvalues_iq4nl
#include <immintrin.h>
#else
#define DFLASH2_KQUANT_ROWS 0
#endif

#if DFLASH2_KQUANT_ROWS
namespace {

constexpr int QK = 256;
// Activation rows that one unpacking of a weight superblock serves (their accumulators stay in registers).
constexpr int MAX_TILE_ROWS = 8;
// How far ahead of its reads a tile over several activation rows asks for a weight row's superblocks.
constexpr int PREFETCH_BLOCKS = 4;
// Weight rows that meet every group of activation rows before the next rows are read (a prompt's
// many groups then find them in L2 rather than in memory): about 256 KB of weights.
constexpr size_t WEIGHT_ROWS_BYTES = size_t(256) << 10;
// The largest work buffer the kernel asks for (a prompt batch is the most); beyond, ggml's own.
constexpr size_t MAX_WORK = size_t(64) << 20;

// An activation superblock: ggml's q8_K block (quants, scale, 16-wide sums), the 32-wide sums
// (pairs of those) that the minimums of Q4_K and Q5_K meet, and for weights that meet them offset
// by 128 (IQ4_XS), -128 times the sums of each dword's 4 quants (4 chunks of 16 lanes).
struct activation {
    const block_q8_K * q;
    const int16_t * sums32;  // 8
    const int32_t * neg_sums;  // 64, where the weight type has `offset`
};

// Where chunk q's dword lane k finds its scale for vpdpwssd: word 2k of the permute is the scale's
// index (`group` of k), word 2k + 1 a zero (word 16, past the 16 scales). A constant per q once the
// callers' loops over q unroll.
template <class Group> inline __m512i scale_index(int q, Group group) {
    return _mm512_set_epi16(16, group(q, 15), 16, group(q, 14), 16, group(q, 13), 16, group(q, 12), 16, group(q, 11), 16, group(q, 10),
                            16, group(q, 9), 16, group(q, 8), 16, group(q, 7), 16, group(q, 6), 16, group(q, 5), 16, group(q, 4), 16,
                            group(q, 3), 16, group(q, 2), 16, group(q, 1), 16, group(q, 0));
}
// Q6_K's 16-wide groups (lane k of chunk q: group 4q + k/4) and the 32-wide groups of Q4_K and Q5_K
// (group 2q + k/8).
inline short group16(int q, int k) { return (short) (4 * q + k / 4); }
inline short group32(int q, int k) { return (short) (2 * q + k / 8); }

// A superblock's weights as the products meet them: four 64-weight chunks of unsigned bytes
// (chunk q: weights 64q..64q+63, ggml's order) and each chunk's scales for vpdpwssd.
struct unpacked {
    __m512i w[4];
    __m512i sc[4];
};

// The lanes of one superblock: sum over chunks of (each dword's 4 products) times its scale, then
// lanes k and k + 8 (weights whose index mod 32 lies in [4(k mod 8), 4(k mod 8) + 4)) added: ggml's 8.
inline __m256i lanes(const unpacked & w, const int8_t * q8) {
    __m512i s = _mm512_setzero_si512();
    for (int q = 0; q < 4; ++q) {
        const __m512i t = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w.w[q], _mm512_loadu_si512(q8 + 64 * q));
        s = _mm512_dpwssd_epi32(s, t, w.sc[q]);
    }
    return _mm256_add_epi32(_mm512_castsi512_si256(s), _mm512_extracti64x4_epi64(s, 1));
}

// ggml_vec_dot_q6_K_q8_K: weights 0..63 (ggml's 6-bit quants, unsigned), 16-weight groups with
// signed 8-bit scales; each lane l subtracts 32 times the scales by the activations' sums of groups
// 2l and 2l + 1 (ggml's q8sclsub); per superblock acc = fma(y.d * x.d, lanes, acc).
struct q6_K {
    using block = block_q6_K;
    static constexpr ggml_type type = GGML_TYPE_Q6_K;
    static constexpr bool offset = false;
    struct weights : unpacked {
        __m256i sc32;  // 32 times the 16 scales, int16
        float d;
    };
    using accumulator = __m256;

    static void unpack(const block & b, weights & out) {
        const __m512i low4 = _mm512_set1_epi8(0x0F), bits45 = _mm512_set1_epi8(0x30);
        // ql[64j..64j+64): low nibbles weights 128j + 0..63, high nibbles 128j + 64..127; qh[32j..32j+32)
        // bits 0-1 / 2-3 / 4-5 / 6-7 the top two bits of weights 128j + b, + 32 + b, + 64 + b, + 96 + b
        const __m512i to45_low = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);   // left
        const __m512i to45_high = _mm512_inserti64x4(_mm512_set1_epi16(0), _mm256_set1_epi16(2), 1);  // right
        for (int j = 0; j < 2; ++j) {
            const __m512i ql = _mm512_loadu_si512(b.ql + 64 * j);
            const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *) (b.qh + 32 * j)));
            const __m512i top_low = _mm512_and_si512(_mm512_sllv_epi16(qh, to45_low), bits45);
            const __m512i top_high = _mm512_and_si512(_mm512_srlv_epi16(qh, to45_high), bits45);
            out.w[2 * j] = _mm512_ternarylogic_epi32(ql, low4, top_low, 0xEA);  // (a & b) | c
            out.w[2 * j + 1] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(ql, 4), low4, top_high, 0xEA);
        }
        const __m256i sc = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *) b.scales));
        const __m512i table = _mm512_zextsi256_si512(sc);
        for (int q = 0; q < 4; ++q) out.sc[q] = _mm512_permutexvar_epi16(scale_index(q, group16), table);
        out.sc32 = _mm256_slli_epi16(sc, 5);
        out.d = _cvtsh_ss(b.d);
    }

    static void start(accumulator & acc) { acc = _mm256_setzero_ps(); }

    static void step(accumulator & acc, const weights & w, const activation & a) {
        __m256i sumi = lanes(w, a.q->qs);
        sumi = _mm256_sub_epi32(sumi, _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *) a.q->bsums), w.sc32));
        const float d = a.q->d * w.d;
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
    }

    static float finish(const accumulator & acc) { return dflash2::hsum_float_8(acc); }
};

// The parts Q4_K and Q5_K share: nibbles of qs[32q..32q+32) are weights 64q + b (low) and 64q + 32 + b
// (high), 32-weight groups with 6-bit scales and minimums; the minimums' part is
// dmin * sum(min[j] * (the activations' sum over group j)), dmin = -y.d * x.dmin.
struct k4_common {
    static constexpr bool offset = false;
    struct weights : unpacked {
        __m128i mins;  // 8 int16
        float d, dmin;
    };

    static void unpack_common(const uint8_t * qs, const uint8_t * scales, ggml_half d, ggml_half dmin, weights & out) {
        const __m512i low4 = _mm512_set1_epi8(0x0F);
        const __m512i nibble = _mm512_inserti64x4(_mm512_set1_epi16(0), _mm256_set1_epi16(4), 1);
        for (int q = 0; q < 4; ++q) {
            const __m512i bytes = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *) (qs + 32 * q)));
            out.w[q] = _mm512_and_si512(_mm512_srlv_epi16(bytes, nibble), low4);
        }
        const __m256i sm = dflash2::k4_scales_and_mins(scales);
        const __m512i table = _mm512_zextsi256_si512(sm);
        for (int q = 0; q < 4; ++q) out.sc[q] = _mm512_permutexvar_epi16(scale_index(q, group32), table);
        out.mins = _mm256_extracti128_si256(sm, 1);
        out.d = _cvtsh_ss(d);
        out.dmin = _cvtsh_ss(dmin);
    }
};

// ggml_vec_dot_q4_K_q8_K: the minimums' parts go into a 4-lane accumulator, acc_m = fma(dmin,
// madd(mins, sums32), acc_m), reduced at the end as (m0 + m2) + (m1 + m3) and added to hsum_float_8.
struct q4_K : k4_common {
    using block = block_q4_K;
    static constexpr ggml_type type = GGML_TYPE_Q4_K;
    struct accumulator {
        __m256 acc;
        __m128 acc_m;
    };

    static void unpack(const block & b, weights & out) { unpack_common(b.qs, b.scales, b.d, b.dmin, out); }

    static void start(accumulator & a) {
        a.acc = _mm256_setzero_ps();
        a.acc_m = _mm_setzero_ps();
    }

    static void step(accumulator & a, const weights & w, const activation & x) {
        const float d = x.q->d * w.d;
        const float dmin = -x.q->d * w.dmin;
        const __m128i prod = _mm_madd_epi16(w.mins, _mm_loadu_si128((const __m128i *) x.sums32));
        a.acc_m = _mm_fmadd_ps(_mm_set1_ps(dmin), _mm_cvtepi32_ps(prod), a.acc_m);
        a.acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(lanes(w, x.q->qs)), a.acc);
    }

    static float finish(const accumulator & a) {
        __m128 m = _mm_add_ps(a.acc_m, _mm_movehl_ps(a.acc_m, a.acc_m));
        m = _mm_add_ss(m, _mm_movehdup_ps(m));
        return dflash2::hsum_float_8(a.acc) + _mm_cvtss_f32(m);
    }
};

// ggml_vec_dot_q5_K_q8_K: bit 2q (2q + 1) of qh[b] is the fifth bit of weight 64q + b (64q + 32 + b);
// the minimums' parts go into a scalar, summs += dmin * sum (fused by ggml's compiler), added to
// hsum_float_8 at the end.
struct q5_K : k4_common {
    using block = block_q5_K;
    static constexpr ggml_type type = GGML_TYPE_Q5_K;
    struct accumulator {
        __m256 acc;
        float summs;
    };

    static void unpack(const block & b, weights & out) {
        unpack_common(b.qs, b.scales, b.d, b.dmin, out);
        const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *) b.qh));
        const __m512i sixteen = _mm512_set1_epi8(16);
        for (int q = 0; q < 4; ++q) {
            const __m512i bit = _mm512_inserti64x4(_mm512_set1_epi8((char) (1 << (2 * q))), _mm256_set1_epi8((char) (1 << (2 * q + 1))), 1);
            out.w[q] = _mm512_mask_add_epi8(out.w[q], _mm512_test_epi8_mask(qh, bit), out.w[q], sixteen);
        }
    }

    static void start(accumulator & a) {
        a.acc = _mm256_setzero_ps();
        a.summs = 0.0f;
    }

    static void step(accumulator & a, const weights & w, const activation & x) {
        const float d = x.q->d * w.d;
        const float dmin = -x.q->d * w.dmin;
        __m128i prod = _mm_madd_epi16(w.mins, _mm_loadu_si128((const __m128i *) x.sums32));
        prod = _mm_add_epi32(prod, _mm_unpackhi_epi64(prod, prod));
        prod = _mm_add_epi32(prod, _mm_srli_epi64(prod, 32));
        a.summs = std::fma(dmin, (float) _mm_cvtsi128_si32(prod), a.summs);
        a.acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(lanes(w, x.q->qs)), a.acc);
    }

    static float finish(const accumulator & a) { return dflash2::hsum_float_8(a.acc) + a.summs; }
};

// ggml_vec_dot_iq4_xs_q8_K: weights from ggml's 16-value table (signed, -127..113) by 4-bit index,
// 32-weight groups with 6-bit scales minus 32; per superblock acc = fma(x.d * y.d, lanes, acc). Four
// such products may pass 16 bits, so here the weights are unsigned (w + 128, their sums counted from
// -128 times the activations' dword sums) and each chunk's lane sums are multiplied by their scale
// in 32 bits (vpmulld).
struct iq4_xs {
    using block = block_iq4_xs;
    static constexpr ggml_type type = GGML_TYPE_IQ4_XS;
    static constexpr bool offset = true;
    struct weights {
        __m512i w[4];
        __m512i ls[4];  // int32: lanes 0-7 group 2q's scale, lanes 8-15 group 2q + 1's
        float d;
    };
    using accumulator = __m256;

    static void unpack(const block & b, weights & out) {
        alignas(16) int8_t shifted[16];
        for (int i = 0; i < 16; ++i) shifted[i] = (int8_t) (kvalues_iq4nl[i] + 128);
        const __m512i table = _mm512_broadcast_i32x4(_mm_load_si128((const __m128i *) shifted));
        const __m512i low4 = _mm512_set1_epi8(0x0F);
        // qs[32q..32q+16): group 2q, low nibbles its weights 0-15, high nibbles 16-31; qs[32q+16..32q+32): group 2q + 1
        const __m512i halves = _mm512_set_epi64(3, 2, 3, 2, 1, 0, 1, 0);
        const __m512i nibble = _mm512_set_epi64(0x0004000400040004, 0x0004000400040004, 0, 0, 0x0004000400040004, 0x0004000400040004, 0, 0);
        for (int q = 0; q < 4; ++q) {
            const __m512i bytes = _mm512_permutexvar_epi64(halves, _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *) (b.qs + 32 * q))));
            out.w[q] = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srlv_epi16(bytes, nibble), low4));
            const int ls0 = ((b.scales_l[q] & 0xf) | ((b.scales_h >> (4 * q) << 4) & 0x30)) - 32;
            const int ls1 = ((b.scales_l[q] >> 4) | ((b.scales_h >> (4 * q) << 2) & 0x30)) - 32;
            out.ls[q] = _mm512_inserti64x4(_mm512_set1_epi32(ls0), _mm256_set1_epi32(ls1), 1);
        }
        out.d = _cvtsh_ss(b.d);
    }

    static void start(accumulator & acc) { acc = _mm256_setzero_ps(); }

    static void step(accumulator & acc, const weights & w, const activation & a) {
        __m512i s = _mm512_setzero_si512();
        for (int q = 0; q < 4; ++q) {
            const __m512i t = _mm512_dpbusd_epi32(_mm512_loadu_si512(a.neg_sums + 16 * q), w.w[q], _mm512_loadu_si512(a.q->qs + 64 * q));
            s = _mm512_add_epi32(s, _mm512_mullo_epi32(t, w.ls[q]));
        }
        const __m256i sumi = _mm256_add_epi32(_mm512_castsi512_si256(s), _mm512_extracti64x4_epi64(s, 1));
        acc = _mm256_fmadd_ps(_mm256_set1_ps(w.d * a.q->d), _mm256_cvtepi32_ps(sumi), acc);
    }

    static float finish(const accumulator & acc) { return dflash2::hsum_float_8(acc); }
};

// Per activation superblock: ggml's q8_K block, its 8 sums over 32 weights and, for weights that
// meet them offset, its 64 negated dword sums.
template <class W> inline size_t work_for(int64_t rows, int64_t blocks) {
    return size_t(rows * blocks) * (sizeof(block_q8_K) + 8 * sizeof(int16_t) + (W::offset ? 64 * sizeof(int32_t) : 0));
}

// One weight row (its superblocks `x`) times G activation rows, each output as ggml's vec_dot
// computes it; *out[g] receives activation row g's.
template <class W, int G> inline void tile(int64_t blocks, const typename W::block * x, const block_q8_K * const * act,
                                           const int16_t * const * sums32, const int32_t * const * neg_sums, float * const * out) {
    typename W::accumulator acc[G];
    for (int g = 0; g < G; ++g) W::start(acc[g]);
    for (int64_t ib = 0; ib < blocks; ++ib) {
        if (G > 1) {
            for (size_t line = 0; line < sizeof(typename W::block); line += 64) {
                _mm_prefetch((const char *) (x + ib + PREFETCH_BLOCKS) + line, _MM_HINT_T0);
            }
        }
        typename W::weights w;
        W::unpack(x[ib], w);
        for (int g = 0; g < G; ++g) W::step(acc[g], w, activation{ act[g] + ib, sums32[g] + 8 * ib, W::offset ? neg_sums[g] + 64 * ib : nullptr });
    }
    for (int g = 0; g < G; ++g) *out[g] = W::finish(acc[g]);
}

template <class W> inline void tile(int G, int64_t blocks, const typename W::block * x, const block_q8_K * const * act,
                                    const int16_t * const * sums32, const int32_t * const * neg_sums, float * const * out) {
    switch (G) {
        case 1: tile<W, 1>(blocks, x, act, sums32, neg_sums, out); break;
        case 2: tile<W, 2>(blocks, x, act, sums32, neg_sums, out); break;
        case 3: tile<W, 3>(blocks, x, act, sums32, neg_sums, out); break;
        case 4: tile<W, 4>(blocks, x, act, sums32, neg_sums, out); break;
        case 5: tile<W, 5>(blocks, x, act, sums32, neg_sums, out); break;
        case 6: tile<W, 6>(blocks, x, act, sums32, neg_sums, out); break;
        case 7: tile<W, 7>(blocks, x, act, sums32, neg_sums, out); break;
        default: tile<W, 8>(blocks, x, act, sums32, neg_sums, out); break;
    }
}

template <class W> class rows_traits : public ggml::cpu::tensor_traits {
  public:
    // A 2-D weight of type W in host memory (ggml's plain CPU buffer: not repacked) by 2-D f32
    // activations, into f32.
    static bool takes(const ggml_tensor * op) {
        const ggml_tensor * x = op->src[0];
        const ggml_tensor * y = op->src[1];
        return op->op == GGML_OP_MUL_MAT && x && y && x->type == W::type && y->type == GGML_TYPE_F32 &&
               op->type == GGML_TYPE_F32 && x->ne[0] % QK == 0 && x->ne[2] == 1 && x->ne[3] == 1 && y->ne[2] == 1 &&
               y->ne[3] == 1 && x->nb[0] == sizeof(typename W::block) && y->nb[0] == sizeof(float) && op->nb[0] == sizeof(float) &&
               work_for<W>(y->ne[1], x->ne[0] / QK) <= MAX_WORK && !x->extra &&
               (!x->buffer || ggml_backend_buffer_is_host(x->buffer));  // no buffer: a plain ggml context's memory
    }

    bool work_size(int, const ggml_tensor * op, size_t & size) override {
        size = work_for<W>(op->src[1]->ne[1], op->src[0]->ne[0] / QK);
        return true;
    }

    bool compute_forward(ggml_compute_params * params, ggml_tensor * op) override {
        if (params->use_ref) {
            return false;  // the reference kernels were asked for
        }
        const ggml_tensor * x = op->src[0];
        const ggml_tensor * y = op->src[1];
        const int64_t k = x->ne[0], blocks = k / QK, n = x->ne[1], m = y->ne[1];
        block_q8_K * quants = static_cast<block_q8_K *>(params->wdata);
        int16_t * sums32 = reinterpret_cast<int16_t *>(quants + m * blocks);
        int32_t * neg_sums = reinterpret_cast<int32_t *>(sums32 + 8 * m * blocks);

        // Every activation row quantized as ggml quantizes it, split between the threads, and its
        // superblocks' 32-wide sums (ggml's hadd of the 16-wide ones) and, where the weights are
        // offset, -128 times its dword sums.
        for (int64_t i = params->ith; i < m; i += params->nth) {
            block_q8_K * row = quants + i * blocks;
            quantize_row_q8_K((const float *) ((const char *) y->data + i * y->nb[1]), row, k);
            for (int64_t b = 0; b < blocks; ++b) {
                const __m256i s16 = _mm256_loadu_si256((const __m256i *) row[b].bsums);
                const __m128i s32 = _mm_hadd_epi16(_mm256_castsi256_si128(s16), _mm256_extracti128_si256(s16, 1));
                _mm_storeu_si128((__m128i *) (sums32 + 8 * (i * blocks + b)), s32);
                if (W::offset) {
                    for (int q = 0; q < 4; ++q) {
                        const __m512i sums = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8((char) 0x80), _mm512_loadu_si512(row[b].qs + 64 * q));
                        _mm512_storeu_si512(neg_sums + 64 * (i * blocks + b) + 16 * q, _mm512_sub_epi32(_mm512_setzero_si512(), sums));
                    }
                }
            }
        }
        ggml_barrier(params->threadpool);

        // The weight rows split between the threads; a run of them meets the activation rows 8 at a time.
        const int64_t first = n * params->ith / params->nth, last = n * (params->ith + 1) / params->nth;
        const int64_t run = std::max<int64_t>(1, (int64_t) (WEIGHT_ROWS_BYTES / x->nb[1]));
        const block_q8_K * act[MAX_TILE_ROWS];
        const int16_t * sums[MAX_TILE_ROWS];
        const int32_t * negs[MAX_TILE_ROWS];
        float * out[MAX_TILE_ROWS];
        for (int64_t r0 = first; r0 < last; r0 += run) {
            const int64_t r1 = std::min(last, r0 + run);
            for (int64_t g0 = 0; g0 < m; g0 += MAX_TILE_ROWS) {
                const int G = (int) std::min<int64_t>(MAX_TILE_ROWS, m - g0);
                for (int g = 0; g < G; ++g) {
                    act[g] = quants + (g0 + g) * blocks;
                    sums[g] = sums32 + 8 * (g0 + g) * blocks;
                    negs[g] = neg_sums + 64 * (g0 + g) * blocks;
                }
                for (int64_t r = r0; r < r1; ++r) {
                    for (int g = 0; g < G; ++g) out[g] = (float *) ((char *) op->data + (g0 + g) * op->nb[1]) + r;
                    tile<W>(G, blocks, (const typename W::block *) ((const char *) x->data + r * x->nb[1]), act, sums, negs, out);
                }
            }
        }
        return true;
    }
};

// One kernel object per type, switched together.
dflash2::op_kernel<rows_traits<q4_K>> q4_K_kernel{ "DFLASH2_Q4_K_ROWS" };
dflash2::op_kernel<rows_traits<q5_K>> q5_K_kernel{ "DFLASH2_Q5_K_ROWS" };
dflash2::op_kernel<rows_traits<q6_K>> q6_K_kernel{ "DFLASH2_Q6_K_ROWS" };
dflash2::op_kernel<rows_traits<iq4_xs>> iq4_xs_kernel{ "DFLASH2_IQ4_XS_ROWS" };

// Random W weights times random activation rows (one of them all zeros, one in 16 values forty
// times larger), of the targets' widths, through ggml's product and the kernel: 1 to 33 activation
// rows (a token tree's), 8 to 137 weight rows.
template <class W> int64_t differences(dflash2::op_kernel<rows_traits<W>> & kernel, std::mt19937 & rng, int n_threads) {
    int64_t differing = 0;
    for (int64_t width : { 256, 1536, 2304 })
        for (int64_t n : { 8, 137 })
            for (int64_t m : { 1, 2, 3, 4, 5, 8, 9, 17, 33 }) {
                ggml_init_params init = { size_t(32) << 20, nullptr, false };
                ggml_context * ctx = ggml_init(init);
                if (!ctx) {
                    return -3;
                }
                ggml_tensor * x = ggml_new_tensor_2d(ctx, W::type, width, n);
                dflash2::random_weights(rng, W::type, x->data, width, n);
                ggml_tensor * y = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, width, m);
                dflash2::random_rows(rng, y, 16);
                const int64_t d = kernel.differences(ctx, ggml_mul_mat(ctx, x, y), n_threads);
                ggml_free(ctx);
                if (d < 0) {
                    return d;
                }
                differing += d;
            }
    return differing;
}

}  // namespace
#endif

extern "C" int32_t dflash2_set_kquant_rows(bool on) {
#if DFLASH2_KQUANT_ROWS
    const int32_t a = q4_K_kernel.set(on), b = q5_K_kernel.set(on), c = q6_K_kernel.set(on), d = iq4_xs_kernel.set(on);
    return a == b && b == c && c == d ? a : 0;
#else
    (void) on;
    return -1;
#endif
}

extern "C" int64_t dflash2_kquant_rows_differences(uint32_t seed, int32_t n_threads) {
#if DFLASH2_KQUANT_ROWS
    try {
        std::mt19937 rng(seed);
        int64_t total = 0;
        for (int64_t d : { differences(q4_K_kernel, rng, n_threads), differences(q5_K_kernel, rng, n_threads),
                           differences(q6_K_kernel, rng, n_threads), differences(iq4_xs_kernel, rng, n_threads) }) {
            if (d < 0) {
                return d;
            }
            total += d;
        }
        return total;
    } catch (...) {
        return -3;
    }
#else
    (void) seed, (void) n_threads;
    return -1;
#endif
}
