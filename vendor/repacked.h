// dflash2's kernels for weights that ggml repacked (its CPU_REPACK buffer: vendor/q4_x8_rows.cpp,
// vendor/kx8_rows.cpp). ggml keeps the traits of such a weight in `tensor->extra` and asks them
// before any extra buffer type, so these kernels do not plug in as one (vendor/cpu_extra.h): they
// sit in front of those traits, weight by weight, when a target loads.
#pragma once

#include "cpu_extra.h"

#include "ggml-backend.h"
#include "ggml-cpu/repack.h"  // the repack buffer type, the repacked block types
#include "llama-model.h"

#include <atomic>
#include <mutex>
#include <random>
#include <unordered_map>

namespace dflash2 {

// ggml's traits of a repacked weight with `Kernel` in front: the products Kernel::takes go to
// Kernel::compute (in the work buffer of Kernel::work_size), the rest (and the reference kernels,
// when asked for) to ggml's.
template <class Kernel> class repacked_front final : public ggml::cpu::tensor_traits {
  public:
    explicit repacked_front(ggml::cpu::tensor_traits * ggml) : ggml(ggml) {}

    bool work_size(int n_threads, const ggml_tensor * op, size_t & size) override {
        if (!Kernel::takes(op)) {
            return ggml->work_size(n_threads, op, size);
        }
        size = Kernel::work_size(op);
        return true;
    }

    bool compute_forward(ggml_compute_params * params, ggml_tensor * op) override {
        if (params->use_ref || !Kernel::takes(op)) {
            return ggml->compute_forward(params, op);
        }
        Kernel::compute(params, op);
        return true;
    }

  private:
    ggml::cpu::tensor_traits * ggml;
};

// Whether `t` lives in ggml's repack buffer, with its traits.
inline bool in_repack_buffer(const ggml_tensor * t) {
    return t->buffer && t->extra && ggml_backend_buffer_get_type(t->buffer) == ggml_backend_cpu_repack_buffer_type();
}

// Puts Kernel in front of `t`'s traits (once; one front per traits object of ggml, alive as long as
// ggml's own).
template <class Kernel> void put_in_front(ggml_tensor * t) {
    static std::mutex lock;
    static std::unordered_map<ggml::cpu::tensor_traits *, repacked_front<Kernel> *> fronts;
    std::lock_guard<std::mutex> guard(lock);
    auto * traits = static_cast<ggml::cpu::tensor_traits *>(t->extra);
    if (dynamic_cast<repacked_front<Kernel> *>(traits)) {
        return;
    }
    auto & front = fronts[traits];
    if (!front) {
        front = new repacked_front<Kernel>(traits);
    }
    t->extra = front;
}

// Puts Kernel in front of every weight of `model` that Kernel::repacked (the layout it reads), and
// counts them in `count`. Returns how many; 0 on an error (no exception crosses the C entries).
template <class Kernel> int32_t put_in_front_of_model(llama_model * model, std::atomic<int64_t> & count) {
    try {
        int32_t n = 0;
        for (auto & named : model->tensors_by_name) {
            if (in_repack_buffer(named.second) && Kernel::repacked(named.second)) {
                put_in_front<Kernel>(named.second);
                ++n;
            }
        }
        count.fetch_add(n, std::memory_order_relaxed);
        return n;
    } catch (...) {
        return 0;
    }
}

// A 2-D weight of `type`, `n` rows of `width`, repacked by ggml from `quants` (its plain layout),
// in a buffer of ggml's repack type that the caller frees; null where ggml would not repack it.
inline ggml_tensor * repacked_weight(ggml_context * meta, ggml_type type, int64_t width, int64_t n, const void * quants,
                                     ggml_backend_buffer_t & buffer) {
    ggml_tensor * x = ggml_new_tensor_2d(meta, type, width, n);
    buffer = ggml_backend_buft_alloc_buffer(ggml_backend_cpu_repack_buffer_type(), ggml_nbytes(x));
    if (!buffer || ggml_backend_tensor_alloc(buffer, x, ggml_backend_buffer_get_base(buffer)) != GGML_STATUS_SUCCESS) {
        return nullptr;
    }
    ggml_backend_tensor_set(x, quants, 0, ggml_nbytes(x));  // ggml repacks it here
    return in_repack_buffer(x) ? x : nullptr;
}

// A random check `check(rng)` drawn from `seed`, the kernel's switch (which the check turns)
// restored afterwards: -3 on any error (no exception crosses the C entries).
template <class Check> int64_t seeded_check(std::atomic<bool> & enabled, uint32_t seed, Check check) {
    const bool was_on = enabled.load();
    try {
        std::mt19937 rng(seed);
        const int64_t d = check(rng);
        enabled.store(was_on);
        return d;
    } catch (...) {
        enabled.store(was_on);
        return -3;
    }
}

}  // namespace dflash2

// The four C entries (vendor/dflash2_shim.h) of a weight type W's kernel in a file that defines, in
// an anonymous namespace, the templates kernel<W>, enabled<W>, fronted<W> and differences<W>, built
// where `built` (the file's feature test) is 1; elsewhere they report that they are not built (-1).
#define DFLASH2_REPACKED_ROWS_ENTRIES(built, name, W) DFLASH2_REPACKED_ROWS_ENTRIES_(built, name, W)
#define DFLASH2_REPACKED_ROWS_ENTRIES_(built, name, W) DFLASH2_REPACKED_ROWS_ENTRIES_##built(name, W)
#define DFLASH2_REPACKED_ROWS_ENTRIES_1(name, W)                                                                                    \
    extern "C" int32_t dflash2_model_##name##_rows(struct llama_model * model) {                                                 \
        return dflash2::put_in_front_of_model<kernel<W>>(model, fronted<W>);                                                      \
    }                                                                                                                             \
    extern "C" int32_t dflash2_set_##name##_rows(bool on) {                                                                       \
        enabled<W>.store(on, std::memory_order_relaxed);                                                                          \
        return on ? 1 : 0;                                                                                                        \
    }                                                                                                                             \
    extern "C" int64_t dflash2_##name##_rows_fronted(void) { return fronted<W>.load(std::memory_order_relaxed); }                 \
    extern "C" int64_t dflash2_##name##_rows_differences(uint32_t seed, int32_t n_threads) {                                      \
        return dflash2::seeded_check(enabled<W>, seed, [&](std::mt19937 & rng) { return differences<W>(rng, n_threads); });      \
    }
#define DFLASH2_REPACKED_ROWS_ENTRIES_0(name, W)                                                                                    \
    extern "C" int32_t dflash2_model_##name##_rows(struct llama_model *) { return -1; }                                          \
    extern "C" int32_t dflash2_set_##name##_rows(bool) { return -1; }                                                             \
    extern "C" int64_t dflash2_##name##_rows_fronted(void) { return -1; }                                                         \
    extern "C" int64_t dflash2_##name##_rows_differences(uint32_t, int32_t) { return -1; }
