// dflash2's op kernels in ggml's CPU backend (vendor/cpu_extra.cpp): each plugs in as one more
// of ggml's CPU "extra buffer types", whose traits ggml asks before computing any op.
#pragma once

#include "ggml-cpu.h"
#include "ggml-cpu/traits.h"

#include <atomic>
#include <type_traits>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#if defined(__AVX__)
#include <immintrin.h>
#endif

#if defined(__AVX512VL__) && defined(__AVX512VNNI__) && defined(__F16C__)
#define DFLASH2_Q8_0_OPERANDS 1
#include "ggml-cpu/quants.h"  // quantize_row_q8_0, the block types
#endif

namespace dflash2 {

#if defined(__AVX__)
// ggml's hsum_float_8 (the reduction ending its AVX2 quantized dot products), operation for
// operation, so that kernels rounding as those dot products do share one copy.
inline float hsum_float_8(const __m256 x) {
    __m128 res = _mm256_extractf128_ps(x, 1);
    res = _mm_add_ps(res, _mm256_castps256_ps128(x));
    res = _mm_add_ps(res, _mm_movehl_ps(res, res));
    res = _mm_add_ss(res, _mm_movehdup_ps(res));
    return _mm_cvtss_f32(res);
}
#endif

#if defined(__AVX2__)
// 12 bytes of a Q4_K (Q5_K) block's 6-bit scales and minimums, as ggml's vec_dot and gemv unpack them
// (their utmp arithmetic): 8 scales, then 8 minimums, as int16. A repacked block_q4_Kx8 packs each
// sub-block's 8 columns the same way.
inline __m256i k4_scales_and_mins(const uint8_t * packed) {
    constexpr uint32_t kmask1 = 0x3f3f3f3f, kmask2 = 0x0f0f0f0f, kmask3 = 0x03030303;
    uint32_t utmp[4];
    std::memcpy(utmp, packed, 12);
    utmp[3] = ((utmp[2] >> 4) & kmask2) | (((utmp[1] >> 6) & kmask3) << 4);
    const uint32_t uaux = utmp[1] & kmask1;
    utmp[1] = (utmp[2] & kmask2) | (((utmp[0] >> 6) & kmask3) << 4);
    utmp[2] = uaux;
    utmp[0] &= kmask1;
    return _mm256_cvtepu8_epi16(_mm_set_epi32(utmp[3], utmp[2], utmp[1], utmp[0]));
}
#endif

#if DFLASH2_Q8_0_OPERANDS
// A q8_0 block of activations (or queries) as ggml's AVX2 dot products meet it, laid out for weights
// made unsigned, w + 2^shift (Q5_0: 4, Q8_0: 7): ggml's quants, its scale widened to f32, and
// -2^shift times the sums of its 8 lanes of 4 quants, from which one unsigned-by-signed product
// counts the exact integer lane sums of ggml's signed one. (Q4_1's q8_1 activations fill only the
// quants and the scale: its weights are unsigned in ggml's product too, which starts from zero.)
struct q8_0_operand {
    int32_t neg_sums[8];
    int8_t qs[32];
    float d;
};

// `k` values quantized as ggml quantizes them (quantize_row_q8_0, into `scratch`: k / 32 blocks),
// laid out as operands for weights made unsigned by 2^shift.
template <int shift> inline void q8_0_operands(const float * x, int64_t k, block_q8_0 * scratch, q8_0_operand * out) {
    quantize_row_q8_0(x, scratch, k);
    for (int64_t b = 0; b < k / 32; ++b) {
        const __m256i qs = _mm256_loadu_si256((const __m256i *) scratch[b].qs);
        const __m256i sums = _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_set1_epi8((char) (1 << shift)), qs);
        _mm256_storeu_si256((__m256i *) out[b].neg_sums, _mm256_sub_epi32(_mm256_setzero_si256(), sums));
        _mm256_storeu_si256((__m256i *) out[b].qs, qs);
        out[b].d = _cvtsh_ss(scratch[b].d);
    }
}

// A q8_0 block's weights as unsigned bytes w + 128 (-128 included, which ggml's signed product
// also takes exactly).
inline __m256i unsigned_q8_0(const block_q8_0 & b) {
    return _mm256_xor_si256(_mm256_loadu_si256((const __m256i *) b.qs), _mm256_set1_epi8((char) 0x80));
}

// One block of ggml's AVX2 dot product: the exact lane sums of the unsigned weights `w` by the
// operand, counted from its -2^shift lane sums (from zero where the weights are unsigned in ggml's
// product too, `Offset` false: Q4_1), times the weight's scale (`w_scale`, broadcast) times the
// operand's, added to `acc` in one fused multiply-add. The scales' product is ggml's scalar one,
// rounded once, taken lane by lane: one multiply by the operand's scale broadcast from memory,
// where a scalar product and its broadcast cost a Q4_1 verify of 8 rows 9% (BENCHMARKS.md (s)).
template <bool Offset = true> inline __m256 q8_0_dot_step(__m256 acc, __m256i w, __m256 w_scale, const q8_0_operand & a) {
    const __m256i start = Offset ? _mm256_loadu_si256((const __m256i *) a.neg_sums) : _mm256_setzero_si256();
    const __m256i lanes = _mm256_dpbusd_epi32(start, w, _mm256_loadu_si256((const __m256i *) a.qs));
    return _mm256_fmadd_ps(_mm256_mul_ps(w_scale, _mm256_broadcast_ss(&a.d)), _mm256_cvtepi32_ps(lanes), acc);
}
#endif

// Computes `out` (whose graph lives in `ctx`, inputs recomputed by the graph itself) on n_threads
// threads with a kernel switched off (`turn(false)`: ggml's) and on, and counts the output elements
// whose bytes differ. Leaves the kernel on.
template <class Switch> int64_t differences(ggml_context * ctx, ggml_tensor * out, int n_threads, Switch turn) {
    ggml_cgraph * graph = ggml_new_graph(ctx);
    ggml_build_forward_expand(graph, out);
    const size_t bytes = ggml_nbytes(out), element = ggml_type_size(out->type);
    turn(false);
    ggml_graph_compute_with_ctx(ctx, graph, n_threads);
    std::vector<char> ggmls((const char *) out->data, (const char *) out->data + bytes);
    std::memset(out->data, 0x7f, bytes);  // NaNs where a float output is left unwritten
    turn(true);
    ggml_graph_compute_with_ctx(ctx, graph, n_threads);
    int64_t differing = 0;
    for (size_t i = 0; i < bytes; i += element) {
        differing += std::memcmp(ggmls.data() + i, (const char *) out->data + i, element) != 0;
    }
    return differing;
}

// Computes each of `rows` (products of one activation row each, whose graphs live in `ctx`) with a
// kernel switched off (`turn(false)`: ggml's), and `batch` (the same rows in one product) with it
// on, and counts the elements of `batch` whose bytes differ from its row's: for kernels that must
// give a batch the bits ggml gives each row alone, where ggml's own batch kernel rounds otherwise.
// Leaves the kernel on.
template <class Switch>
int64_t differences_by_row(ggml_context * ctx, ggml_tensor * batch, const std::vector<ggml_tensor *> & rows, int n_threads, Switch turn) {
    ggml_cgraph * singles = ggml_new_graph(ctx);
    for (ggml_tensor * row : rows) ggml_build_forward_expand(singles, row);
    turn(false);
    ggml_graph_compute_with_ctx(ctx, singles, n_threads);
    ggml_cgraph * batched = ggml_new_graph(ctx);
    ggml_build_forward_expand(batched, batch);
    std::memset(batch->data, 0x7f, ggml_nbytes(batch));  // NaNs where an output is left unwritten
    turn(true);
    ggml_graph_compute_with_ctx(ctx, batched, n_threads);
    int64_t differing = 0;
    for (size_t i = 0; i < rows.size(); ++i) {
        const char * ours = (const char *) batch->data + i * batch->nb[1];
        for (int64_t j = 0; j < batch->ne[0]; ++j) {
            differing += std::memcmp(ours + j * sizeof(float), (const char *) rows[i]->data + j * sizeof(float), sizeof(float)) != 0;
        }
    }
    return differing;
}

// What the products' random checks multiply. Weights: n rows of `width` values uniform in (-2, 2),
// one in 8 forty times larger (blocks dominated by one value), quantized by ggml into `data`; a
// q8_0 weight also gets -128 at 16 places, a valid quant that ggml's quantizer never writes.
void random_weights(std::mt19937 & rng, ggml_type type, void * data, int64_t width, int64_t n);
// Activation rows: values uniform in (-2, 2), one in `outliers` (0: none) forty times larger; the
// first row all zeros (a zero scale) where there are several.
void random_rows(std::mt19937 & rng, ggml_tensor * y, uint32_t outliers);

// Adds `extra` to ggml's CPU extra buffer types, once per object (later calls find it there).
// Returns false where the CPU backend could not be found. Not safe while anything in the process
// computes: ggml reads that list without a lock.
bool register_cpu_extra(ggml::cpu::extra_buffer_type * extra, const char * name);

// Traits that must also take some ops while switched off define `static bool takes_when_off(op)`.
template <class Traits, class = void> struct takes_when_off {
    static bool check(const ggml_tensor *) { return false; }
};
template <class Traits> struct takes_when_off<Traits, std::void_t<decltype(&Traits::takes_when_off)>> {
    static bool check(const ggml_tensor * op) { return Traits::takes_when_off(op); }
};

// A kernel as an extra buffer type: no buffer is ever made of it (supports_op is false, so
// llama.cpp places no weight in it); it lends its traits to the ops `Traits::takes` while it is on
// (and to those `Traits::takes_when_off`, where defined, while it is off).
// `name`: the buffer type's name in ggml's reports.
template <class Traits> class op_kernel : public ggml::cpu::extra_buffer_type {
  public:
    explicit op_kernel(const char * name) : name(name) {}

    bool supports_op(ggml_backend_dev_t, const ggml_tensor *) override { return false; }

    ggml::cpu::tensor_traits * get_tensor_traits(const ggml_tensor * op) override {
        const bool taken = enabled.load(std::memory_order_relaxed) ? Traits::takes(op) : takes_when_off<Traits>::check(op);
        return taken ? &traits : nullptr;
    }

    bool on() const { return enabled.load(std::memory_order_relaxed); }

    // Turns the kernel on or off for the whole process (registering it the first time): 1 on,
    // 0 off or not registered.
    int32_t set(bool on) {
        try {
            enabled.store(on, std::memory_order_relaxed);
            if (register_cpu_extra(this, name)) {
                return on ? 1 : 0;
            }
        } catch (...) {
        }
        enabled.store(false);
        return 0;
    }

    // Computes `out` (whose graph lives in `ctx`, inputs recomputed by the graph itself) with ggml's
    // kernel and with this one, on n_threads threads, and counts the output elements whose bytes
    // differ: -2 where this kernel would not take the op. Leaves the kernel as it found it.
    int64_t differences(ggml_context * ctx, ggml_tensor * out, int n_threads) {
        if (!Traits::takes(out)) {
            return -2;
        }
        const bool was_on = on();
        const int64_t differing = dflash2::differences(ctx, out, n_threads, [this](bool on) { set(on); });
        set(was_on);
        return differing;
    }

  private:
    const char * name;
    std::atomic<bool> enabled{ false };
    Traits traits;
};

}  // namespace dflash2
