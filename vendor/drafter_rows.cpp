// Products of a DFlash drafter's Q8_0 weights in integers, with one scale per row.
//
// ggml multiplies Q8_0 weights by activations quantized to q8_0 blocks: per 32-wide block an
// integer dot product, converted to float and multiplied by the two blocks' scales. That float
// work per block is most of the instructions: vendor/quant_rows.cpp keeps it (its outputs are
// ggml's, bit for bit, which a target's products must be) and still spends 42-58% of a drafter
// call in it on a 2-core EPYC (BENCHMARKS.md (p)).
//
// A drafter's numerics never reach the generated text: the target verifies every drafted token.
// So for the drafter's own weights (adopted by its context for as long as it lives,
// dflash2_adopt_drafter_weights), this kernel takes the products in integers from end to end:
// - each weight row requantized once, at first use, to signed bytes with one scale for the row
//   (the row's largest magnitude as 127), and the row's byte sum kept;
// - each activation row quantized at every product to bytes with one scale for the row (its largest
//   magnitude as 127), held as unsigned bytes q + 128 for the unsigned-by-signed byte product
//   (vpdpbusd), the + 128 taken back with the weight row's sum;
// - per (weight row, activation row) one exact integer sum, converted and scaled once at the end.
// One instruction per 32 products where ggml takes five (an integer product, its conversion, a
// scale product and its broadcast, a fused multiply-add). Both operands' one scale per row makes
// the rounding coarser than ggml's per-32 scales; dflash2_drafter_rows_excess() checks every output
// against the bound that follows (half a step of each row's scale), and BENCHMARKS.md (q) measures
// the drafter's acceptance with and without the kernel (1.4% fewer tokens at a fixed block of 8 with
// greedy selection, 0.5% more with trees: near ties reorder).
//
// Built for AVX-512 CPUs with VNNI in the same `-march=native` build as llama.cpp; elsewhere
// dflash2_set_drafter_rows() reports that it is not built.

#include "dflash2_shim.h"
#include "cpu_extra.h"

#include "ggml-backend.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <shared_mutex>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__) && defined(__F16C__)
#define DFLASH2_DRAFTER_ROWS 1
#include "ggml-cpu/quants.h"  // block_q8_0
#include <immintrin.h>
#else
#define DFLASH2_DRAFTER_ROWS 0
#endif

#if DFLASH2_DRAFTER_ROWS
namespace {

constexpr int QK = 32;

// The widest weight row the kernel takes: a row's integer sum adds k products of at most 255 * 127
// (below 2^31 up to k = 66,000); the bound keeps the work buffer small.
constexpr int64_t MAX_K = 16384;

// The largest work buffer the kernel asks for (a prompt's injection is the most); beyond, ggml's.
constexpr size_t MAX_WORK = size_t(64) << 20;

// One activation row: its bytes q + 128, then its scale (64 bytes kept for it).
inline size_t row_bytes(int64_t k) { return size_t(k) + 64; }
inline size_t work_for(int64_t rows, int64_t k) { return size_t(rows) * row_bytes(k); }

// A Q8_0 weight in signed bytes with one scale per row.
struct int8_weights {
    const void * data = nullptr;  // the Q8_0 data they were made from
    int64_t k = 0, n = 0;
    std::vector<int8_t> q;       // n rows of k
    std::vector<float> scale;    // weight ~ scale * q
    std::vector<int32_t> offset; // -128 * the row's sum of q: the activations' + 128, taken back
};

// An adopted weight: how many holders adopted it, its integer form once made.
struct adopted {
    int holders = 0;
    std::mutex making;
    std::unique_ptr<int8_weights> made;
};

std::shared_mutex registry_lock;
std::atomic<int64_t> made_total{ 0 };  // integer forms made in this process
std::map<const ggml_tensor *, std::unique_ptr<adopted>> registry;

adopted * find(const ggml_tensor * w) {
    std::shared_lock<std::shared_mutex> guard(registry_lock);
    auto it = registry.find(w);
    return it == registry.end() ? nullptr : it->second.get();
}

std::unique_ptr<int8_weights> requantize(const ggml_tensor * x) {
    auto w = std::make_unique<int8_weights>();
    w->data = x->data;
    w->k = x->ne[0];
    w->n = x->ne[1];
    w->q.resize(size_t(w->k * w->n));
    w->scale.resize(size_t(w->n));
    w->offset.resize(size_t(w->n));
    std::vector<float> row(size_t(w->k));
    for (int64_t r = 0; r < w->n; ++r) {
        const block_q8_0 * blocks = (const block_q8_0 *) ((const char *) x->data + r * x->nb[1]);
        float amax = 0.0f;
        for (int64_t b = 0; b < w->k / QK; ++b) {
            const float d = _cvtsh_ss(blocks[b].d);
            for (int i = 0; i < QK; ++i) {
                row[size_t(b * QK + i)] = d * blocks[b].qs[i];
                amax = std::max(amax, std::fabs(row[size_t(b * QK + i)]));
            }
        }
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        int8_t * q = w->q.data() + r * w->k;
        int32_t sum = 0;
        for (int64_t i = 0; i < w->k; ++i) {
            q[i] = (int8_t) std::clamp(std::lrintf(row[size_t(i)] * inv), -127L, 127L);
            sum += q[i];
        }
        w->scale[size_t(r)] = amax / 127.0f;
        w->offset[size_t(r)] = -128 * sum;
    }
    return w;
}

// The weight's integer form, made by the first thread that asks (the others wait for it).
const int8_weights * integer_form(const ggml_tensor * x) {
    adopted * a = find(x);
    if (!a) {
        return nullptr;
    }
    std::lock_guard<std::mutex> guard(a->making);
    if (!a->made || a->made->data != x->data) {
        a->made = requantize(x);
        ++made_total;
    }
    return a->made.get();
}

// An activation row as bytes q + 128 with one scale (the row's largest magnitude as 127).
void quantize_row(const float * x, int64_t k, uint8_t * q, float * scale) {
    __m512 amax = _mm512_setzero_ps();
    for (int64_t i = 0; i < k; i += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_loadu_ps(x + i)));
    const float m = _mm512_reduce_max_ps(amax);
    *scale = m / 127.0f;
    const __m512 inv = _mm512_set1_ps(m > 0.0f ? 127.0f / m : 0.0f);
    for (int64_t i = 0; i < k; i += 16) {
        const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + i), inv));
        _mm_storeu_si128((__m128i *) (q + i), _mm512_cvtepi32_epi8(_mm512_add_epi32(v, _mm512_set1_epi32(128))));
    }
}

inline int32_t hsum_i32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}

struct activation_row {
    const uint8_t * q;
    float scale;
};

// R weight rows (consecutive, from r0) times G activation rows; out[g][r] receives row r's
// product with activation row g. The R x G sums and G activation vectors stay in registers, each
// weight vector read once for all of them. (R = 4, G = 2 measured fastest on a 2-core EPYC: a
// drafter call 20% faster than with G = 4's 16 sums, which GCC copies between registers at every
// product.)
template <int R, int G>
inline void tile(const int8_weights & wt, int64_t r0, const activation_row * act, float * const * out) {
    const int64_t k = wt.k;
    const int8_t * w = wt.q.data() + r0 * k;
    __m256i sum[R * G];
#pragma GCC unroll 16
    for (int j = 0; j < R * G; ++j) sum[j] = _mm256_setzero_si256();
    for (int64_t i = 0; i < k; i += QK) {
        __m256i a[G];
#pragma GCC unroll 4
        for (int g = 0; g < G; ++g) a[g] = _mm256_loadu_si256((const __m256i *) (act[g].q + i));
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
            const __m256i wr = _mm256_loadu_si256((const __m256i *) (w + r * k + i));
#pragma GCC unroll 4
            for (int g = 0; g < G; ++g) sum[r * G + g] = _mm256_dpbusd_epi32(sum[r * G + g], a[g], wr);
        }
    }
    for (int r = 0; r < R; ++r) {
        const int64_t row = r0 + r;
        for (int g = 0; g < G; ++g) {
            const int32_t dot = hsum_i32(sum[r * G + g]) + wt.offset[size_t(row)];
            out[g][r] = float(dot) * (wt.scale[size_t(row)] * act[g].scale);
        }
    }
}

class drafter_rows_traits : public ggml::cpu::tensor_traits {
  public:
    // An adopted 2-D Q8_0 weight of rows a multiple of 4, in host memory (ggml's plain CPU
    // buffer: not repacked), by 2-D f32 activations, into f32.
    static bool takes(const ggml_tensor * op) {
        const ggml_tensor * x = op->src[0];
        const ggml_tensor * y = op->src[1];
        return op->op == GGML_OP_MUL_MAT && x && y && x->type == GGML_TYPE_Q8_0 && y->type == GGML_TYPE_F32 &&
               op->type == GGML_TYPE_F32 && x->ne[0] % QK == 0 && x->ne[0] <= MAX_K && x->ne[1] % 4 == 0 && x->ne[2] == 1 &&
               x->ne[3] == 1 && y->ne[2] == 1 && y->ne[3] == 1 && ggml_is_contiguous(x) && y->nb[0] == sizeof(float) &&
               op->nb[0] == sizeof(float) && work_for(y->ne[1], x->ne[0]) <= MAX_WORK && !x->extra &&
               (!x->buffer || ggml_backend_buffer_is_host(x->buffer)) && find(x) != nullptr;
    }

    bool work_size(int, const ggml_tensor * op, size_t & size) override {
        size = work_for(op->src[1]->ne[1], op->src[0]->ne[0]);
        return true;
    }

    bool compute_forward(ggml_compute_params * params, ggml_tensor * op) override {
        if (params->use_ref) {
            return false;  // the reference kernels were asked for
        }
        const ggml_tensor * x = op->src[0];
        const ggml_tensor * y = op->src[1];
        const int64_t k = x->ne[0], n = x->ne[1], m = y->ne[1];
        const int8_weights * wt = integer_form(x);
        if (!wt) {
            return false;  // forgotten since the graph was planned: ggml's product (in a larger work buffer)
        }
        uint8_t * work = static_cast<uint8_t *>(params->wdata);
        auto row = [&](int64_t i) {
            uint8_t * base = work + size_t(i) * row_bytes(k);
            return activation_row{ base, *(const float *) (base + k) };
        };
        for (int64_t i = params->ith; i < m; i += params->nth) {
            uint8_t * base = work + size_t(i) * row_bytes(k);
            quantize_row((const float *) ((const char *) y->data + i * y->nb[1]), k, base, (float *) (base + k));
        }
        ggml_barrier(params->threadpool);

        // Weight rows split between the threads in runs of 4, each meeting the activation rows
        // two at a time (the run's weights stay in the first-level cache meanwhile).
        constexpr int R = 4;
        const int64_t runs = n / R;
        const int64_t first = runs * params->ith / params->nth * R;
        const int64_t last = runs * (params->ith + 1) / params->nth * R;
        activation_row act[2];
        float * out[2];
        for (int64_t r0 = first; r0 < last; r0 += R) {
            for (int64_t g0 = 0; g0 < m; g0 += 2) {
                const int G = (int) std::min<int64_t>(2, m - g0);
                for (int g = 0; g < G; ++g) {
                    act[g] = row(g0 + g);
                    out[g] = (float *) ((char *) op->data + (g0 + g) * op->nb[1]) + r0;
                }
                if (G == 2) {
                    tile<R, 2>(*wt, r0, act, out);
                } else {
                    tile<R, 1>(*wt, r0, act, out);
                }
            }
        }
        return true;
    }
};

dflash2::op_kernel<drafter_rows_traits> kernel{ "DFLASH2_DRAFTER_ROWS" };

void adopt(const ggml_tensor * w) {
    std::unique_lock<std::shared_mutex> guard(registry_lock);
    auto & a = registry[w];
    if (!a) {
        a = std::make_unique<adopted>();
    }
    ++a->holders;
}

void forget(const ggml_tensor * w) {
    std::unique_lock<std::shared_mutex> guard(registry_lock);
    auto it = registry.find(w);
    if (it != registry.end() && --it->second->holders <= 0) {
        registry.erase(it);
    }
}

// A row as the kernel quantizes it (weights and activations alike): q_i = rint(v_i * 127 / max |v|)
// in float, its scale max |v| / 127.
float quantized(const float * v, int64_t k, std::vector<int32_t> & q) {
    float amax = 0.0f;
    for (int64_t i = 0; i < k; ++i) amax = std::max(amax, std::fabs(v[i]));
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    q.resize(size_t(k));
    for (int64_t i = 0; i < k; ++i) q[size_t(i)] = (int32_t) std::lrintf(v[i] * inv);
    return amax / 127.0f;
}

// Random Q8_0 weights (some at the ends of their range, -128 too) times random activation rows
// (one of them all zeros; some with values 40 times the rest), of the drafters' widths, through
// the kernel. Counts the outputs that differ in any bit from the same scheme taken one product at
// a time (the scalar reference: rows quantized as above, an exact integer sum, scaled once), or
// whose reference lies further from the exact product of the Q8_0 weights and the f32 activations
// (in double) than the scheme's error bound: the weights' and the activations' half steps,
// |w - w'| <= s_w / 2 and |a - a'| <= s_a / 2, summed over the row,
// sum_i (s_w / 2 |a_i| + (|w_i| + s_w / 2) s_a / 2), plus float rounding.
int64_t excess(std::mt19937 & rng, int n_threads) {
    int64_t beyond = 0;
    for (int64_t width : { 32, 576, 1536, 2880 })
        for (int64_t n : { 4, 136 })
            for (int64_t m : { 1, 2, 3, 4, 8, 17 }) {
                ggml_init_params init = { size_t(32) << 20, nullptr, false };
                ggml_context * ctx = ggml_init(init);
                if (!ctx) {
                    return -3;
                }
                ggml_tensor * x = ggml_new_tensor_2d(ctx, GGML_TYPE_Q8_0, width, n);
                dflash2::random_weights(rng, GGML_TYPE_Q8_0, x->data, width, n);
                ggml_tensor * y = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, width, m);
                dflash2::random_rows(rng, y, 64);
                ggml_tensor * out = ggml_mul_mat(ctx, x, y);
                adopt(x);
                const bool taken = drafter_rows_traits::takes(out);
                const bool was_on = kernel.on();
                kernel.set(true);
                ggml_cgraph * graph = ggml_new_graph(ctx);
                ggml_build_forward_expand(graph, out);
                std::memset(out->data, 0x7f, ggml_nbytes(out));  // NaNs where an output is left unwritten
                if (taken) {
                    ggml_graph_compute_with_ctx(ctx, graph, n_threads);
                }
                kernel.set(was_on);
                forget(x);
                if (!taken) {
                    ggml_free(ctx);
                    return -2;
                }
                std::vector<float> w((size_t) width);
                std::vector<int32_t> qw, qa;
                for (int64_t r = 0; r < n; ++r) {
                    const block_q8_0 * blocks = (const block_q8_0 *) ((const char *) x->data + r * x->nb[1]);
                    for (int64_t i = 0; i < width; ++i) w[size_t(i)] = _cvtsh_ss(blocks[i / QK].d) * blocks[i / QK].qs[i % QK];
                    const float sw = quantized(w.data(), width, qw);
                    for (int64_t j = 0; j < m; ++j) {
                        const float * a = (const float *) y->data + j * width;
                        const float sa = quantized(a, width, qa);
                        int64_t dot = 0;
                        double exact = 0.0, magnitude = 0.0, bound = 0.0;
                        for (int64_t i = 0; i < width; ++i) {
                            dot += int64_t(qw[size_t(i)]) * qa[size_t(i)];
                            exact += double(w[size_t(i)]) * a[i];
                            magnitude += std::fabs(double(w[size_t(i)]) * a[i]);
                            bound += double(sw) / 2 * std::fabs(double(a[i])) + (std::fabs(double(w[size_t(i)])) + double(sw) / 2) * double(sa) / 2;
                        }
                        const float reference = float(dot) * (sw * sa);
                        const float got = ((const float *) ((const char *) out->data + j * out->nb[1]))[r];
                        const bool within = std::fabs(double(reference) - exact) <= bound * (1 + 1e-5) + 1e-6 * magnitude;
                        beyond += std::memcmp(&got, &reference, sizeof(float)) != 0 || !within;
                    }
                }
                ggml_free(ctx);
            }
    return beyond;
}

}  // namespace
#endif

extern "C" int32_t dflash2_set_drafter_rows(bool on) {
#if DFLASH2_DRAFTER_ROWS
    return kernel.set(on);
#else
    (void) on;
    return -1;
#endif
}

extern "C" void dflash2_drafter_rows_adopt(const struct ggml_tensor * weight, bool adopt_it) {
#if DFLASH2_DRAFTER_ROWS
    try {
        if (adopt_it) {
            adopt(weight);
        } else {
            forget(weight);
        }
    } catch (...) {
    }
#else
    (void) weight, (void) adopt_it;
#endif
}

extern "C" int64_t dflash2_drafter_rows_made(void) {
#if DFLASH2_DRAFTER_ROWS
    return made_total.load();
#else
    return 0;
#endif
}

extern "C" int64_t dflash2_drafter_rows_excess(uint32_t seed, int32_t n_threads) {
#if DFLASH2_DRAFTER_ROWS
    try {
        std::mt19937 rng(seed);
        return excess(rng, n_threads);
    } catch (...) {
        return -3;
    }
#else
    (void) seed, (void) n_threads;
    return -1;
#endif
}
