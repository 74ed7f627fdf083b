// Few-row matrix products for the weights llama.cpp repacks for AMX.
//
// ggml's AMX backend multiplies a repacked weight by one activation row with an AVX512-VNNI
// kernel, and by two or more rows with AMX tiles made for 32 rows, unpacking every 4-bit weight
// tile to int8 on each call. A verify of a few rows pays that fixed cost in full: on a 2-core
// Sapphire Rapids a 2-row decode of SmolLM2 Q4_0 costs 2.0 single steps (BENCHMARKS.md (l)).
//
// These kernels compute such a product the way the single-row kernel computes each row: the same
// integer dot products per 32-wide block, the same float operations in the same order. So every
// output has the bits a single-token decode gives it (which ggml's AMX tiles give too: the engine's
// batch-invariance probe compares them). What changes is that each weight tile is loaded and
// unpacked once for all rows. The hook swaps the tensor traits ggml keeps in `tensor->extra` of the
// AMX buffer's weights; everything the kernels do not take goes to ggml's own traits.
//
// Compiled only where ggml's AMX backend is (the same `-march=native` build); elsewhere
// dflash2_model_few_row_kernels() reports that it is not built.

#include "dflash2_shim.h"

#include "ggml-backend.h"
#include "ggml-cpu/traits.h"
#include "llama-model.h"

#include <cstring>
#include <mutex>
#include <unordered_map>

#if defined(__AMX_INT8__) && defined(__AVX512VNNI__) && defined(__AVX512F__) && defined(__F16C__)
#define DFLASH2_FEW_ROWS 1
#include "ggml-cpu/quants.h"  // quantize_row_q8_0, and the block types
#include <immintrin.h>
#else
#define DFLASH2_FEW_ROWS 0
#endif

#if DFLASH2_FEW_ROWS
namespace {

// ggml's AMX packing (ggml-cpu/amx/common.h and mmq.cpp): a weight of N outputs and K inputs is
// stored as N/16 column tiles, each a run of K/32 blocks; a block holds the 16 columns' quants in
// VNNI order, then their 16 fp16 scales (and for q8_0, 16 int32 sums of 128 * b).
constexpr int TILE_N = 16;
constexpr int TILE_K = 32;
constexpr size_t packed_index(int n, int k, int KB, size_t tile_size) { return (size_t(n) * KB + k) * tile_size; }

inline size_t tile_size(ggml_type type) {
    switch (type) {
        case GGML_TYPE_Q4_0: return TILE_N * sizeof(block_q4_0);
        case GGML_TYPE_Q4_1: return TILE_N * sizeof(block_q4_1);
        default: return TILE_N * sizeof(block_q8_0) + TILE_N * sizeof(int32_t);  // q8_0
    }
}

// The activations' block for a weight type (ggml's vec_dot_type: q8_1 beside q4_1, else q8_0)
// and the quantizer ggml fills it with.
struct activation_type {
    size_t block_size;
    void (*quantize)(const float *, void *, int64_t);
};

inline activation_type activation_for(ggml_type type) {
    if (type == GGML_TYPE_Q4_1) {
        return { sizeof(block_q8_1), quantize_row_q8_1 };
    }
    return { sizeof(block_q8_0), quantize_row_q8_0 };
}

inline bool few_row_type(ggml_type type) {
    return type == GGML_TYPE_Q4_0 || type == GGML_TYPE_Q4_1 || type == GGML_TYPE_Q8_0;
}

inline float fp16_to_fp32(ggml_half h) { return _cvtsh_ss(h); }

// A 4-bit tile block's 32 k as 8 registers of unsigned bytes, in the order of the a values they
// multiply (low nibbles of each 64 bytes, then high), as ggml's kernels unpack them.
inline void unpack_nibbles(const char * b, __m512i vb[8]) {
    const __m512i low = _mm512_set1_epi8(0xF);
    for (int k = 0; k < 8; k += 2) {
        const __m512i bytes = _mm512_loadu_si512((const __m512i *) (b + k * 32));
        vb[k] = _mm512_and_si512(bytes, low);
        vb[k + 1] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low);
    }
}

// Rows m < M of C[m][0..16*COLS) = A[m] x B for one group of COLS column tiles, A being M rows of
// KB activation blocks. q4_0 weights: as tinygemm_kernel_vnni<q8_0, q4_0> computes each row.
template <int M, int COLS>
void q4_0_rows(int KB, const void * A_, const char * B, float * C, int ldc) {
    const block_q8_0 * A = static_cast<const block_q8_0 *>(A_);
    const size_t TILE_SIZE = tile_size(GGML_TYPE_Q4_0);
    const __m512i off = _mm512_set1_epi8(8);
    __m512 vc[M][COLS];
    for (int m = 0; m < M; ++m)
        for (int c = 0; c < COLS; ++c) vc[m][c] = _mm512_setzero_ps();
    for (int i = 0; i < KB; ++i) {
        // a * (b - 8) = b * a - 8 * a: b unsigned, a signed (VNNI multiplies u8 by s8)
        __m512i comp[M];
        __m512 d1[M];
        for (int m = 0; m < M; ++m) {
            const int32_t * a = reinterpret_cast<const int32_t *>(A[m * KB + i].qs);
            comp[m] = _mm512_setzero_si512();
            for (int k = 0; k < 8; ++k) comp[m] = _mm512_dpbusd_epi32(comp[m], off, _mm512_set1_epi32(a[k]));
            d1[m] = _mm512_set1_ps(fp16_to_fp32(A[m * KB + i].d));
        }
        for (int c = 0; c < COLS; ++c) {
            const char * b = B + packed_index(c, i, KB, TILE_SIZE);
            __m512i vb[8];
            unpack_nibbles(b, vb);
            const __m512 d0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) (b + TILE_N * TILE_K / 2)));
            for (int m = 0; m < M; ++m) {
                const int32_t * a = reinterpret_cast<const int32_t *>(A[m * KB + i].qs);
                __m512i sum = _mm512_setzero_si512();
                for (int k = 0; k < 8; ++k) sum = _mm512_dpbusd_epi32(sum, vb[k], _mm512_set1_epi32(a[k]));
                sum = _mm512_sub_epi32(sum, comp[m]);
                vc[m][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(d0, d1[m]), vc[m][c]);
            }
        }
    }
    for (int m = 0; m < M; ++m)
        for (int c = 0; c < COLS; ++c) _mm512_storeu_ps(C + m * ldc + c * 16, vc[m][c]);
}

// q8_0 weights: as tinygemm_kernel_vnni<q8_0, q8_0> per row (a + 128 unsigned, the packing's
// per-column sums of 128 * b subtracted).
template <int M, int COLS>
void q8_0_rows(int KB, const void * A_, const char * B, float * C, int ldc) {
    const block_q8_0 * A = static_cast<const block_q8_0 *>(A_);
    const size_t TILE_SIZE = tile_size(GGML_TYPE_Q8_0);
    const __m512i off = _mm512_set1_epi8(static_cast<char>(0x80));
    __m512 vc[M][COLS];
    for (int m = 0; m < M; ++m)
        for (int c = 0; c < COLS; ++c) vc[m][c] = _mm512_setzero_ps();
    for (int i = 0; i < KB; ++i) {
        __m512 d1[M];
        for (int m = 0; m < M; ++m) d1[m] = _mm512_set1_ps(fp16_to_fp32(A[m * KB + i].d));
        for (int c = 0; c < COLS; ++c) {
            const char * b = B + packed_index(c, i, KB, TILE_SIZE);
            __m512i vb[8];
            for (int k = 0; k < 8; ++k) vb[k] = _mm512_loadu_si512((const __m512i *) (b + k * 64));
            const __m512 d0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) (b + TILE_N * TILE_K)));
            const __m512i comp =
                _mm512_loadu_si512((const __m512i *) (b + TILE_N * TILE_K + TILE_N * sizeof(ggml_half)));
            for (int m = 0; m < M; ++m) {
                const int32_t * a = reinterpret_cast<const int32_t *>(A[m * KB + i].qs);
                __m512i sum = _mm512_setzero_si512();
                for (int k = 0; k < 8; ++k)
                    sum = _mm512_dpbusd_epi32(sum, _mm512_add_epi8(_mm512_set1_epi32(a[k]), off), vb[k]);
                sum = _mm512_sub_epi32(sum, comp);
                vc[m][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(d0, d1[m]), vc[m][c]);
            }
        }
    }
    for (int m = 0; m < M; ++m)
        for (int c = 0; c < COLS; ++c) _mm512_storeu_ps(C + m * ldc + c * 16, vc[m][c]);
}

// q4_1 weights: as tinygemm_kernel_vnni<q8_1, q4_1> (b unsigned, no compensation; the weight's
// minimum times the activation block's d * sum(a) added after the scaled dot product).
template <int M, int COLS>
void q4_1_rows(int KB, const void * A_, const char * B, float * C, int ldc) {
    const block_q8_1 * A = static_cast<const block_q8_1 *>(A_);
    const size_t TILE_SIZE = tile_size(GGML_TYPE_Q4_1);
    __m512 vc[M][COLS];
    for (int m = 0; m < M; ++m)
        for (int c = 0; c < COLS; ++c) vc[m][c] = _mm512_setzero_ps();
    for (int i = 0; i < KB; ++i) {
        __m512 d1[M], s1[M];
        for (int m = 0; m < M; ++m) {
            d1[m] = _mm512_set1_ps(fp16_to_fp32(A[m * KB + i].d));
            s1[m] = _mm512_set1_ps(fp16_to_fp32(A[m * KB + i].s));
        }
        for (int c = 0; c < COLS; ++c) {
            const char * b = B + packed_index(c, i, KB, TILE_SIZE);
            __m512i vb[8];
            unpack_nibbles(b, vb);
            const int offset = TILE_N * TILE_K / 2;
            const __m512 d0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) (b + offset)));
            const __m512 m0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) (b + offset + TILE_N * sizeof(ggml_half))));
            for (int m = 0; m < M; ++m) {
                const int32_t * a = reinterpret_cast<const int32_t *>(A[m * KB + i].qs);
                __m512i sum = _mm512_setzero_si512();
                for (int k = 0; k < 8; ++k) sum = _mm512_dpbusd_epi32(sum, vb[k], _mm512_set1_epi32(a[k]));
                vc[m][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(d0, d1[m]), vc[m][c]);
                vc[m][c] = _mm512_fmadd_ps(m0, s1[m], vc[m][c]);
            }
        }
    }
    for (int m = 0; m < M; ++m)
        for (int c = 0; c < COLS; ++c) _mm512_storeu_ps(C + m * ldc + c * 16, vc[m][c]);
}

template <int M, int COLS>
void rows_cols(ggml_type type, int KB, const void * A, const char * B, float * C, int ldc) {
    switch (type) {
        case GGML_TYPE_Q4_0: q4_0_rows<M, COLS>(KB, A, B, C, ldc); break;
        case GGML_TYPE_Q4_1: q4_1_rows<M, COLS>(KB, A, B, C, ldc); break;
        default: q8_0_rows<M, COLS>(KB, A, B, C, ldc); break;
    }
}

// M rows by `cols` column tiles of a weight of `type`, in groups as wide as the registers allow:
// the M x COLS accumulators and the 8 unpacked weight registers within 32, so 4 tiles at a time
// up to 3 rows and 2 beyond.
template <int M>
void rows_in_groups(ggml_type type, int cols, int KB, const void * A, const char * B, float * C, int ldc) {
    constexpr int WIDE = M <= 3 ? 4 : 2;
    for (int h = 0; h < cols;) {
        const int left = std::min(WIDE, cols - h);
        const int n = left == 3 ? 2 : left;  // 3 tiles: 2, then 1
        const char * b = B + packed_index(h, 0, KB, tile_size(type));
        float * c = C + h * TILE_N;
        switch (n) {
            case 4: if constexpr (WIDE == 4) rows_cols<M, 4>(type, KB, A, b, c, ldc); break;
            case 2: rows_cols<M, 2>(type, KB, A, b, c, ldc); break;
            default: rows_cols<M, 1>(type, KB, A, b, c, ldc); break;
        }
        h += n;
    }
}

void rows(int M, ggml_type type, int cols, int KB, const void * A, const char * B, float * C, int ldc) {
    switch (M) {
        case 2: rows_in_groups<2>(type, cols, KB, A, B, C, ldc); break;
        case 3: rows_in_groups<3>(type, cols, KB, A, B, C, ldc); break;
        case 4: rows_in_groups<4>(type, cols, KB, A, B, C, ldc); break;
        case 5: rows_in_groups<5>(type, cols, KB, A, B, C, ldc); break;
        default: rows_in_groups<6>(type, cols, KB, A, B, C, ldc); break;
    }
}

// The largest row count these kernels take: at 8 rows ggml's AMX tiles cost as much (measured on
// SmolLM2 Q4_0, BENCHMARKS.md (l)).
constexpr int64_t MAX_ROWS = 6;

class few_rows_traits : public ggml::cpu::tensor_traits {
  public:
    explicit few_rows_traits(ggml::cpu::tensor_traits * amx) : amx(amx) {}

    // The work buffer is ggml's (the quantized activation rows), sized by its traits.
    bool work_size(int n_threads, const ggml_tensor * op, size_t & size) override {
        return amx->work_size(n_threads, op, size);
    }

    bool compute_forward(ggml_compute_params * params, ggml_tensor * op) override {
        if (!takes(op)) {
            return amx->compute_forward(params, op);
        }
        const ggml_tensor * w = op->src[0];
        const ggml_tensor * x = op->src[1];
        const int M = (int) op->ne[1];
        const int N = (int) op->ne[0];
        const int K = (int) w->ne[0];
        const int KB = K / TILE_K;
        const int ldc = (int) (op->nb[1] / op->nb[0]);
        // The activation rows to ggml's type for this weight (q8_1 beside q4_1, else q8_0), as ggml
        // quantizes them, a row per thread; then one barrier.
        const activation_type act = activation_for(w->type);
        const size_t row_size = size_t(KB) * act.block_size;
        char * a = static_cast<char *>(params->wdata);
        for (int m = params->ith; m < M; m += params->nth) {
            act.quantize((const float *) ((const char *) x->data + m * x->nb[1]), a + m * row_size, K);
        }
        ggml_barrier(params->threadpool);
        // Split the column tiles in groups of 4 between threads, as ggml's single-row path does.
        const int n_tiles = N / TILE_N;
        const int groups = (n_tiles + 3) / 4;
        const int per = (groups + params->nth - 1) / params->nth;
        const int g0 = params->ith * per;
        const int g1 = std::min(groups, g0 + per);
        for (int g = g0; g < g1; ++g) {
            const int tile = g * 4;
            const int cols = std::min(4, n_tiles - tile);
            const char * b = (const char *) w->data + packed_index(tile, 0, KB, tile_size(w->type));
            float * c = (float *) op->data + tile * TILE_N;
            rows(M, w->type, cols, KB, a, b, c, ldc);
        }
        return true;
    }

  private:
    // A 2-d product of 2..MAX_ROWS f32 rows with one q4_0, q4_1 or q8_0 weight; the rest is ggml's.
    static bool takes(const ggml_tensor * op) {
        const ggml_tensor * w = op->src[0];
        const ggml_tensor * x = op->src[1];
        return op->op == GGML_OP_MUL_MAT && few_row_type(w->type) &&
               x->type == GGML_TYPE_F32 && op->ne[1] >= 2 && op->ne[1] <= MAX_ROWS && op->ne[2] == 1 &&
               op->ne[3] == 1 && w->ne[0] % TILE_K == 0 && op->ne[0] % TILE_N == 0 && x->nb[0] == sizeof(float) &&
               op->nb[0] == sizeof(float);
    }

    ggml::cpu::tensor_traits * amx;
};

}  // namespace
#endif

extern "C" int32_t dflash2_model_few_row_kernels(struct llama_model * model) {
#if DFLASH2_FEW_ROWS
    try {
        // One wrapper per traits object of ggml (there is one, a static of the AMX backend).
        static std::mutex lock;
        static std::unordered_map<ggml::cpu::tensor_traits *, few_rows_traits *> wrappers;
        std::lock_guard<std::mutex> guard(lock);
        int32_t n = 0;
        for (auto & named : model->tensors_by_name) {
            ggml_tensor * t = named.second;
            if (!t->buffer || !t->extra || !few_row_type(t->type)) {
                continue;
            }
            if (std::strcmp(ggml_backend_buft_name(ggml_backend_buffer_get_type(t->buffer)), "AMX") != 0) {
                continue;
            }
            auto * traits = static_cast<ggml::cpu::tensor_traits *>(t->extra);
            if (dynamic_cast<few_rows_traits *>(traits)) {
                ++n;
                continue;
            }
            auto & wrapper = wrappers[traits];
            if (!wrapper) {
                wrapper = new few_rows_traits(traits);  // lives as long as ggml's own
            }
            t->extra = wrapper;
            ++n;
        }
        return n;
    } catch (...) {
        return 0;
    }
#else
    (void) model;
    return -1;
#endif
}
