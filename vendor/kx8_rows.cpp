// Products of the K-quant weights ggml repacks for AVX2 CPUs (block_q4_Kx8; block_q2_Kx8, which it
// repacks on AVX-512 CPUs) with activation rows.
//
// ggml repacks a Q4_K (Q2_K) weight into runs of 8 columns (the 8 columns' superblock scales and
// minimum scales, their sub-block scales and minimums, and their quants interleaved 8 bytes at a
// time) and multiplies it by one activation row with ggml_gemv_q4_K_8x8_q8_K (_q2_K_): per
// superblock and column, the exact integers sum(scale_j * dot_j) and sum(min_j * (the activations'
// sum over sub-block j)), then acc = fma(float(dots), d * y.d, acc) and acc_min = fma(float(mins),
// dmin * y.d, acc_min), the superblocks in order, and acc - acc_min. Its gemm for four rows at a time
// rounds differently (0.4 in a Qwen2.5-Coder-1.5B logit on a 2-core EPYC), so a target whose
// verifies must reproduce single steps was loaded unrepacked, 36% slower.
//
// This kernel gives every output the gemv's bits, for any number of rows: the same integers,
// counted otherwise, and the same float operations. A 64-byte run of the repacked quants holds 8
// bytes of each of 8 columns (one column's dword lanes 2c and 2c + 1, 4 weights each); each nibble
// (2-bit field) of it meets the activations' 8 matching quants, broadcast to every qword, in one
// vpdpbusd (16 products a lane for a Q4_K sub-block, 8 for Q2_K's, which fit 16 bits), and one
// vpdpwssd multiplies the lanes by their column's sub-block scale; a column's two lanes are added
// once per superblock. Each run is unpacked once for up to 8 activation rows. It sits in front of
// ggml's traits of the weights that a target load puts it before (vendor/repacked.h).
//
// Built for AVX-512 CPUs with VNNI in the same `-march=native` build as llama.cpp; elsewhere
// dflash2_set_q4_kx8_rows() and dflash2_set_q2_kx8_rows() report that it is not built.

#include "dflash2_shim.h"
#include "repacked.h"

#include <algorithm>
#include <random>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__) && defined(__F16C__)
#define DFLASH2_KX8_ROWS 1
#include "ggml-cpu/quants.h"  // quantize_row_q8_K (ggml's quantizer for the activations)
#include <immintrin.h>
#else
#define DFLASH2_KX8_ROWS 0
#endif

#if DFLASH2_KX8_ROWS
namespace {

constexpr int QK = 256;
// Activation rows that one unpacking of a run serves (their integer lanes stay in registers).
constexpr int MAX_TILE_ROWS = 8;
// How far ahead of its reads a tile asks for the run's superblocks (1168 bytes each for Q4_K).
constexpr int PREFETCH_BLOCKS = 2;
// Runs of 8 columns that meet every group of activation rows before the next runs are read (a
// prompt's many groups then find them in L2 rather than in memory): about 256 KB of weights.
constexpr size_t RUN_BYTES = size_t(256) << 10;
// The largest work buffer the kernel asks for (a prompt batch is the most); beyond, ggml's own.
constexpr size_t MAX_WORK = size_t(64) << 20;

template <class W> std::atomic<bool> enabled{ false };
template <class W> std::atomic<int64_t> fronted{ 0 };  // weights of models it sits in front of, for reports

// Per activation superblock: ggml's q8_K block and its 8 sums over 32 quants.
inline size_t work_for(int64_t rows, int64_t blocks) { return size_t(rows * blocks) * (sizeof(block_q8_K) + 8 * sizeof(int16_t)); }

// 8 activation quants broadcast to every qword (a column's two dword lanes meet 4 each); 2 int16
// broadcast to every dword.
inline __m512i broadcast8(const int8_t * q8) {
    int64_t v;
    std::memcpy(&v, q8, sizeof(v));
    return _mm512_set1_epi64(v);
}
inline __m256i broadcast4(const int16_t * pair) {
    int32_t v;
    std::memcpy(&v, pair, sizeof(v));
    return _mm256_set1_epi32(v);
}

// A repacked superblock's 6-bit scales and minimums, as the products meet them. Sub-block j's 12
// bytes B (at 12j) pack the 8 columns' as a Q4_K block packs its 8 sub-blocks': column c < 4 has
// scale B[c] & 63 and minimum B[4 + c] & 63; column c >= 4 has scale (B[4 + c] & 15) | (B[c - 4] >> 6)
// << 4 and minimum (B[4 + c] >> 4) | (B[c] >> 6) << 4.
#if defined(__AVX512VBMI__)
// All 64 of each unpacked at once, byte 8j + c holding column c's in sub-block j.
class q4_K_scales {
  public:
    explicit q4_K_scales(const block_q4_Kx8 & b) {
        // per byte 8j + c: P = B[c], Q = B[4 + c], R = B[c - 4] (c >= 4) of sub-block j's bytes
        alignas(64) static const struct tables {
            uint8_t p[64], q[64], r[64];
            tables() {
                for (int j = 0; j < 8; ++j)
                    for (int c = 0; c < 8; ++c) {
                        p[8 * j + c] = (uint8_t) (12 * j + c);
                        q[8 * j + c] = (uint8_t) (12 * j + 4 + c);
                        r[8 * j + c] = (uint8_t) (12 * j + (c < 4 ? c : c - 4));
                    }
            }
        } idx;
        // the 96 bytes of scales (and, past them, quants that no index reaches)
        const __m512i lo = _mm512_loadu_si512(b.scales), hi = _mm512_loadu_si512(b.scales + 64);
        const __m512i p = _mm512_permutex2var_epi8(lo, _mm512_load_si512(idx.p), hi);
        const __m512i q = _mm512_permutex2var_epi8(lo, _mm512_load_si512(idx.q), hi);
        const __m512i r = _mm512_permutex2var_epi8(lo, _mm512_load_si512(idx.r), hi);
        const __m512i low4 = _mm512_set1_epi8(0x0F), low6 = _mm512_set1_epi8(0x3F), bits45 = _mm512_set1_epi8(0x30);
        const __mmask64 high_columns = 0xF0F0F0F0F0F0F0F0ull;  // c >= 4
        // (x >> 6) << 4 of each byte is (x >> 2) & 0x30 of its 16-bit lane
        const __m512i s_high = _mm512_ternarylogic_epi32(q, low4, _mm512_and_si512(_mm512_srli_epi16(r, 2), bits45), 0xEA);  // (a & b) | c
        const __m512i m_high = _mm512_ternarylogic_epi32(_mm512_srli_epi16(q, 4), low4, _mm512_and_si512(_mm512_srli_epi16(p, 2), bits45), 0xEA);
        s = _mm512_mask_blend_epi8(high_columns, _mm512_and_si512(p, low6), s_high);
        m = _mm512_mask_blend_epi8(high_columns, _mm512_and_si512(q, low6), m_high);
    }

    // Sub-block j's scales for vpdpwssd: dword lane 2c + h holds column c's in its low 16 bits.
    __m512i scale(int j) const {
        const __m512i lane = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
        return _mm512_maskz_permutexvar_epi8(0x1111111111111111ull, _mm512_add_epi32(lane, _mm512_set1_epi32(8 * j)), s);
    }

    // The minimums of sub-blocks 2k and 2k + 1 as int16 pairs, a dword lane per column.
    __m256i min_pair(int k) const {
        // byte 0 of lane c: sub-block 2k's minimum (byte 16k + c), byte 2: sub-block 2k + 1's (16k + 8 + c)
        const __m256i lane = _mm256_set_epi32(0x000F0007, 0x000E0006, 0x000D0005, 0x000C0004, 0x000B0003, 0x000A0002, 0x00090001, 0x00080000);
        return _mm256_maskz_permutexvar_epi8(0x55555555u, _mm256_add_epi8(lane, _mm256_set1_epi16((short) (16 * k))), _mm512_castsi512_si256(k < 2 ? m : _mm512_shuffle_i64x2(m, m, 0xEE)));
    }

  private:
    __m512i s, m;
};
#else
// Sub-block by sub-block, as ggml's gemv unpacks them: per sub-block the 8 scales, then the 8
// minimums, as int16.
class q4_K_scales {
  public:
    explicit q4_K_scales(const block_q4_Kx8 & b) {
        for (int j = 0; j < 8; ++j) sm[j] = dflash2::k4_scales_and_mins(b.scales + 12 * j);
    }

    __m512i scale(int j) const {
        // word 2L of the permute: the scale of column L / 2 (a column's two dword lanes), word 2L + 1: a zero
        const __m512i lane = _mm512_set_epi16(16, 7, 16, 7, 16, 6, 16, 6, 16, 5, 16, 5, 16, 4, 16, 4, 16, 3, 16, 3, 16, 2, 16, 2, 16, 1, 16, 1,
                                              16, 0, 16, 0);
        return _mm512_permutexvar_epi16(lane, _mm512_zextsi256_si512(sm[j]));
    }

    __m256i min_pair(int k) const {
        const __m128i m0 = _mm256_extracti128_si256(sm[2 * k], 1), m1 = _mm256_extracti128_si256(sm[2 * k + 1], 1);
        return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_unpacklo_epi16(m0, m1)), _mm_unpackhi_epi16(m0, m1), 1);
    }

  private:
    __m256i sm[8];
};
#endif

// The weight types: their repacked superblock's integers for G activation rows at once. `dots[g]`
// receives, for activation row g, sum over sub-blocks of scale * dot in dword lanes 2c and 2c + 1
// (column c's, to be added), `mins[g]` sum over sub-blocks of minimum * (the activations' sum over
// the sub-block) in dword lane c; `sums32` are the activation superblocks' 8 sums over 32 quants.
struct q4_K {
    using block = block_q4_Kx8;
    static constexpr ggml_type type = GGML_TYPE_Q4_K;

    template <int G>
    static void integers(const block & b, const block_q8_K * const * act, const int16_t * const * sums32, __m512i (&dots)[G], __m256i (&mins)[G]) {
        const __m512i low4 = _mm512_set1_epi8(0x0F);
        const q4_K_scales scales(b);
        for (int sb = 0; sb < 4; ++sb) {
            const __m512i scale0 = scales.scale(2 * sb), scale1 = scales.scale(2 * sb + 1);
            // run r: 8 bytes of each column, its low nibbles weights 64sb + 8r + 0..7 (sub-block 2sb),
            // its high nibbles weights 64sb + 32 + 8r + 0..7 (sub-block 2sb + 1)
            __m512i lo[4], hi[4];
            for (int r = 0; r < 4; ++r) {
                const __m512i raw = _mm512_loadu_si512(b.qs + 256 * sb + 64 * r);
                lo[r] = _mm512_and_si512(raw, low4);
                hi[r] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
            }
            for (int g = 0; g < G; ++g) {
                const int8_t * q8 = act[g]->qs + 64 * sb;
                __m512i t0 = _mm512_setzero_si512(), t1 = _mm512_setzero_si512();
                for (int r = 0; r < 4; ++r) {
                    t0 = _mm512_dpbusd_epi32(t0, lo[r], broadcast8(q8 + 8 * r));
                    t1 = _mm512_dpbusd_epi32(t1, hi[r], broadcast8(q8 + 32 + 8 * r));
                }
                dots[g] = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(dots[g], t0, scale0), t1, scale1);
            }
        }
        for (int g = 0; g < G; ++g)
            for (int k = 0; k < 4; ++k) mins[g] = _mm256_dpwssd_epi32(mins[g], scales.min_pair(k), broadcast4(sums32[g] + 2 * k));
    }
};

// Q2_K: per 128-weight half sb, run r holds bytes 8r..8r+7 of each column's 32 bytes, whose 2-bit
// field l is weight 32l + 8r + 0..7 of the half: sub-block (16 weights) 2l + r / 2, its weights
// 8 (r % 2) + 0..7. Scales and minimums are 4 bits each, one byte per (column, sub-block): byte
// 16p + 2c + j holds column c's of sub-block 2p + j (p = 0..7 over the superblock), the scale in
// its low nibble.
struct q2_K {
    using block = block_q2_Kx8;
    static constexpr ggml_type type = GGML_TYPE_Q2_K;

    template <int G>
    static void integers(const block & b, const block_q8_K * const * act, const int16_t * const *, __m512i (&dots)[G], __m256i (&mins)[G]) {
        const __m512i low2 = _mm512_set1_epi8(0x03), low4 = _mm512_set1_epi8(0x0F);
        // pshufb indices of sub-block 2p + j's scales in a pair's 16 bytes, broadcast to each 128-bit
        // lane: dword lane L (column L / 2) takes byte 2 (L / 2) + j in its low byte, zeros above
        const __m512i column_byte = _mm512_set_epi32(14, 14, 12, 12, 10, 10, 8, 8, 6, 6, 4, 4, 2, 2, 0, 0);
        const __m512i zeros_above = _mm512_set1_epi32((int) 0x80808000);
        for (int sb = 0; sb < 2; ++sb) {
            __m512i w[4][4];  // [run][field]
            for (int r = 0; r < 4; ++r) {
                const __m512i raw = _mm512_loadu_si512(b.qs + 256 * sb + 64 * r);
                for (int l = 0; l < 4; ++l) w[r][l] = _mm512_and_si512(_mm512_srli_epi16(raw, 2 * l), low2);
            }
            for (int p = 4 * sb; p < 4 * sb + 4; ++p) {
                const __m512i pair = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *) (b.scales + 16 * p)));
                const __m512i scales = _mm512_and_si512(pair, low4);
                for (int j = 0; j < 2; ++j) {
                    const __m512i scale = _mm512_shuffle_epi8(scales, _mm512_or_si512(_mm512_add_epi32(column_byte, _mm512_set1_epi32(j)), zeros_above));
                    const int i = 2 * (p % 4) + j;  // sub-block within the half
                    const int l = i / 2, r0 = 2 * (i % 2);
                    for (int g = 0; g < G; ++g) {
                        const int8_t * q8 = act[g]->qs + 128 * sb + 16 * i;
                        __m512i t = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[r0][l], broadcast8(q8));
                        t = _mm512_dpbusd_epi32(t, w[r0 + 1][l], broadcast8(q8 + 8));
                        dots[g] = _mm512_dpwssd_epi32(dots[g], t, scale);
                    }
                }
                // column c's minimums of sub-blocks 2p and 2p + 1, as int16 pairs in dword lane c
                const __m256i min_pairs = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(_mm512_castsi512_si128(pair), 4), _mm_set1_epi8(0x0F)));
                for (int g = 0; g < G; ++g) mins[g] = _mm256_dpwssd_epi32(mins[g], min_pairs, broadcast4(act[g]->bsums + 2 * p));
            }
        }
    }
};

// One run of 8 columns times G activation rows (their q8_K superblocks `act`, their 32-wide sums
// `sums32`), each output as ggml's gemv computes it; out[g] receives row g's 8 outputs.
template <class W, int G>
void tile(int64_t blocks, const typename W::block * w, const block_q8_K * const * act, const int16_t * const * sums32, float * const * out) {
    __m256 acc[G], acc_min[G];
    for (int g = 0; g < G; ++g) acc[g] = acc_min[g] = _mm256_setzero_ps();
    for (int64_t ib = 0; ib < blocks; ++ib) {
        const typename W::block & b = w[ib];
        for (int line = 0; line < (int) sizeof(b); line += 64) {
            _mm_prefetch((const char *) (&b + PREFETCH_BLOCKS) + line, _MM_HINT_T0);
        }
        const block_q8_K * rows[G];
        const int16_t * sums[G];
        __m512i dots[G];
        __m256i mins[G];
        for (int g = 0; g < G; ++g) {
            rows[g] = act[g] + ib;
            sums[g] = sums32[g] + 8 * ib;
            dots[g] = _mm512_setzero_si512();
            mins[g] = _mm256_setzero_si256();
        }
        W::template integers<G>(b, rows, sums, dots, mins);
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) b.d));
        const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) b.dmin));
        for (int g = 0; g < G; ++g) {
            // a column's two lanes added: the gemv's per-column integer
            const __m512i pairs = _mm512_add_epi32(dots[g], _mm512_srli_epi64(dots[g], 32));
            const __m256i columns = _mm512_cvtepi64_epi32(pairs);
            const __m256 row_scale = _mm256_set1_ps(rows[g]->d);
            acc[g] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(columns), _mm256_mul_ps(d, row_scale), acc[g]);
            acc_min[g] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mins[g]), _mm256_mul_ps(dmin, row_scale), acc_min[g]);
        }
    }
    for (int g = 0; g < G; ++g) _mm256_storeu_ps(out[g], _mm256_sub_ps(acc[g], acc_min[g]));
}

template <class W>
void tile(int G, int64_t blocks, const typename W::block * w, const block_q8_K * const * act, const int16_t * const * sums32, float * const * out) {
    switch (G) {
        case 1: tile<W, 1>(blocks, w, act, sums32, out); break;
        case 2: tile<W, 2>(blocks, w, act, sums32, out); break;
        case 3: tile<W, 3>(blocks, w, act, sums32, out); break;
        case 4: tile<W, 4>(blocks, w, act, sums32, out); break;
        case 5: tile<W, 5>(blocks, w, act, sums32, out); break;
        case 6: tile<W, 6>(blocks, w, act, sums32, out); break;
        case 7: tile<W, 7>(blocks, w, act, sums32, out); break;
        default: tile<W, 8>(blocks, w, act, sums32, out); break;
    }
}

template <class W> struct kernel {
    static bool repacked(const ggml_tensor * t) { return t->type == W::type && t->ne[0] % QK == 0 && t->ne[1] % 8 == 0; }

    // 2-D products by f32 rows whose work fits the cap.
    static bool takes(const ggml_tensor * op) {
        const ggml_tensor * x = op->src[0];
        const ggml_tensor * y = op->src[1];
        return enabled<W>.load(std::memory_order_relaxed) && op->op == GGML_OP_MUL_MAT && y->type == GGML_TYPE_F32 &&
               op->type == GGML_TYPE_F32 && x->ne[2] == 1 && x->ne[3] == 1 && y->ne[2] == 1 && y->ne[3] == 1 &&
               y->nb[0] == sizeof(float) && op->nb[0] == sizeof(float) && work_for(y->ne[1], x->ne[0] / QK) <= MAX_WORK;
    }

    static size_t work_size(const ggml_tensor * op) { return work_for(op->src[1]->ne[1], op->src[0]->ne[0] / QK); }

    static void compute(ggml_compute_params * params, ggml_tensor * op) {
        const ggml_tensor * x = op->src[0];
        const ggml_tensor * y = op->src[1];
        const int64_t k = x->ne[0], blocks = k / QK, runs = x->ne[1] / 8, m = y->ne[1];
        block_q8_K * quants = static_cast<block_q8_K *>(params->wdata);
        int16_t * sums32 = reinterpret_cast<int16_t *>(quants + m * blocks);
        // Every activation row quantized as ggml quantizes it, split between the threads, and its
        // superblocks' 32-wide sums (the gemv's hadd of the 16-wide ones).
        for (int64_t i = params->ith; i < m; i += params->nth) {
            block_q8_K * row = quants + i * blocks;
            quantize_row_q8_K((const float *) ((const char *) y->data + i * y->nb[1]), row, k);
            for (int64_t b = 0; b < blocks; ++b) {
                const __m256i s16 = _mm256_loadu_si256((const __m256i *) row[b].bsums);
                _mm_storeu_si128((__m128i *) (sums32 + 8 * (i * blocks + b)),
                                 _mm_hadd_epi16(_mm256_castsi256_si128(s16), _mm256_extracti128_si256(s16, 1)));
            }
        }
        ggml_barrier(params->threadpool);

        // The runs split between the threads; a stretch of them meets the activation rows 8 at a time.
        const auto * w = static_cast<const typename W::block *>(x->data);
        const int64_t first = runs * params->ith / params->nth, last = runs * (params->ith + 1) / params->nth;
        const int64_t stretch = std::max<int64_t>(1, (int64_t) (RUN_BYTES / (blocks * sizeof(typename W::block))));
        const block_q8_K * act[MAX_TILE_ROWS];
        const int16_t * sums[MAX_TILE_ROWS];
        float * out[MAX_TILE_ROWS];
        for (int64_t r0 = first; r0 < last; r0 += stretch) {
            const int64_t r1 = std::min(last, r0 + stretch);
            for (int64_t g0 = 0; g0 < m; g0 += MAX_TILE_ROWS) {
                const int G = (int) std::min<int64_t>(MAX_TILE_ROWS, m - g0);
                for (int g = 0; g < G; ++g) {
                    act[g] = quants + (g0 + g) * blocks;
                    sums[g] = sums32 + 8 * (g0 + g) * blocks;
                }
                for (int64_t r = r0; r < r1; ++r) {
                    for (int g = 0; g < G; ++g) out[g] = (float *) ((char *) op->data + (g0 + g) * op->nb[1]) + 8 * r;
                    tile<W>(G, blocks, w + r * blocks, act, sums, out);
                }
            }
        }
    }
};

// Random W weights, repacked by ggml, times random activation rows (one of them all zeros, one in
// 16 values forty times larger): 1 to 33 rows, 8 to 136 columns, each output against ggml's gemv
// of its row alone (its gemm for several rows rounds otherwise).
template <class W> int64_t differences(std::mt19937 & rng, int n_threads) {
    int64_t differing = 0;
    for (int64_t width : { 256, 1536, 2304 })
        for (int64_t n : { 8, 24, 136 })
            for (int64_t m : { 1, 2, 3, 4, 5, 8, 9, 17, 33 }) {
                ggml_init_params meta_init = { ggml_tensor_overhead(), nullptr, true };
                ggml_context * meta = ggml_init(meta_init);
                ggml_init_params init = { size_t(32) << 20, nullptr, false };
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
                dflash2::random_rows(rng, y, 16);
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

DFLASH2_REPACKED_ROWS_ENTRIES(DFLASH2_KX8_ROWS, q4_kx8, q4_K)
DFLASH2_REPACKED_ROWS_ENTRIES(DFLASH2_KX8_ROWS, q2_kx8, q2_K)
