// dflash2's op kernels in ggml's CPU backend (vendor/cpu_extra.cpp): each plugs in as one more
// of ggml's CPU "extra buffer types", whose traits ggml asks before computing any op.
#pragma once

#include "ggml-cpu/traits.h"

#include <atomic>
#include <cstdint>

namespace dflash2 {

// Adds `extra` to ggml's CPU extra buffer types, once per object (later calls find it there).
// Returns false where the CPU backend could not be found. Not safe while anything in the process
// computes: ggml reads that list without a lock.
bool register_cpu_extra(ggml::cpu::extra_buffer_type * extra, const char * name);

// A kernel as an extra buffer type: no buffer is ever made of it (supports_op is false, so
// llama.cpp places no weight in it); it lends its traits to the ops `Traits::takes` while it is on.
template <class Traits> class op_kernel : public ggml::cpu::extra_buffer_type {
  public:
    bool supports_op(ggml_backend_dev_t, const ggml_tensor *) override { return false; }

    ggml::cpu::tensor_traits * get_tensor_traits(const ggml_tensor * op) override {
        return enabled.load(std::memory_order_relaxed) && Traits::takes(op) ? &traits : nullptr;
    }

    // Turns the kernel on or off for the whole process (registering it the first time): 1 on,
    // 0 off or not registered.
    int32_t set(bool on, const char * name) {
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

  private:
    std::atomic<bool> enabled{ false };
    Traits traits;
};

}  // namespace dflash2
