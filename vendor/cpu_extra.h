// dflash2's op kernels in ggml's CPU backend (vendor/cpu_extra.cpp): each plugs in as one more
// of ggml's CPU "extra buffer types", whose traits ggml asks before computing any op.
#pragma once

#include "ggml-cpu.h"
#include "ggml-cpu/traits.h"

#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX__)
#include <immintrin.h>
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

// Adds `extra` to ggml's CPU extra buffer types, once per object (later calls find it there).
// Returns false where the CPU backend could not be found. Not safe while anything in the process
// computes: ggml reads that list without a lock.
bool register_cpu_extra(ggml::cpu::extra_buffer_type * extra, const char * name);

// A kernel as an extra buffer type: no buffer is ever made of it (supports_op is false, so
// llama.cpp places no weight in it); it lends its traits to the ops `Traits::takes` while it is on.
// `name`: the buffer type's name in ggml's reports.
template <class Traits> class op_kernel : public ggml::cpu::extra_buffer_type {
  public:
    explicit op_kernel(const char * name) : name(name) {}

    bool supports_op(ggml_backend_dev_t, const ggml_tensor *) override { return false; }

    ggml::cpu::tensor_traits * get_tensor_traits(const ggml_tensor * op) override {
        return enabled.load(std::memory_order_relaxed) && Traits::takes(op) ? &traits : nullptr;
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
        ggml_cgraph * graph = ggml_new_graph(ctx);
        ggml_build_forward_expand(graph, out);
        const bool was_on = on();
        const size_t bytes = ggml_nbytes(out), element = ggml_type_size(out->type);
        set(false);
        ggml_graph_compute_with_ctx(ctx, graph, n_threads);
        std::vector<char> ggmls((const char *) out->data, (const char *) out->data + bytes);
        std::memset(out->data, 0x7f, bytes);  // NaNs where a float output is left unwritten
        set(true);
        ggml_graph_compute_with_ctx(ctx, graph, n_threads);
        set(was_on);
        int64_t differing = 0;
        for (size_t i = 0; i < bytes; i += element) {
            differing += std::memcmp(ggmls.data() + i, (const char *) out->data + i, element) != 0;
        }
        return differing;
    }

  private:
    const char * name;
    std::atomic<bool> enabled{ false };
    Traits traits;
};

}  // namespace dflash2
