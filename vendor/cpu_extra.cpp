// Registration of dflash2's op kernels (drafter_conv.cpp, drafter_ops.cpp, drafter_rows.cpp,
// f16_attention.cpp, q8_0_attention.cpp, quant_rows.cpp) with ggml's CPU backend, and the inputs
// their products' random checks draw.

#include "cpu_extra.h"

#define GGML_COMMON_DECL_CPP
#include "ggml-common.h"  // block_q8_0

#include "ggml-backend.h"
#include "ggml-cpu.h"

#include <algorithm>

#include <list>
#include <mutex>

namespace {

// A kernel's buffer type and its name, alive as long as the process (ggml keeps pointers to it).
struct registered {
    ggml_backend_buffer_type type;
    const char * name;
};

std::mutex lock;
std::list<registered> types;

const char * buffer_type_name(ggml_backend_buffer_type_t buft) {
    std::lock_guard<std::mutex> guard(lock);
    for (auto & t : types) {
        if (&t.type == buft) {
            return t.name;
        }
    }
    return "DFLASH2";
}

}  // namespace

namespace dflash2 {

bool register_cpu_extra(ggml::cpu::extra_buffer_type * extra, const char * name) {
    std::lock_guard<std::mutex> guard(lock);
    for (auto & t : types) {
        if (t.type.context == extra) {
            return true;
        }
    }
    // The CPU device copies ggml's list once, for placing weights; have it copied before the
    // kernel joins, so that weights never see this type (it would refuse them anyway).
    ggml_backend_dev_t cpu = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    if (!cpu) {
        return false;
    }
    auto get_extra = (ggml_backend_buffer_type_t * (*) (ggml_backend_dev_t))
        ggml_backend_reg_get_proc_address(ggml_backend_dev_backend_reg(cpu), "ggml_backend_dev_get_extra_bufts");
    if (get_extra) {
        get_extra(cpu);
    }
    auto & t = types.emplace_back();
    t.name = name;
    t.type.iface = ggml_backend_cpu_buffer_type()->iface;
    t.type.iface.get_name = buffer_type_name;
    t.type.device = cpu;
    t.type.context = extra;
    ggml_backend_cpu_get_extra_buffer_types().push_back(&t.type);
    return true;
}

void random_weights(std::mt19937 & rng, ggml_type type, void * data, int64_t width, int64_t n) {
    std::uniform_real_distribution<float> uniform(-2.0f, 2.0f);
    std::vector<float> values(size_t(width * n));
    for (float & v : values) v = uniform(rng) * (rng() % 8 == 0 ? 40.0f : 1.0f);
    ggml_quantize_chunk(type, values.data(), data, 0, n, width, nullptr);
    if (type == GGML_TYPE_Q8_0) {
        auto * blocks = static_cast<block_q8_0 *>(data);
        for (int i = 0; i < 16; ++i) blocks[rng() % (width * n / QK8_0)].qs[rng() % QK8_0] = -128;
    }
}

void random_rows(std::mt19937 & rng, ggml_tensor * y, uint32_t outliers) {
    std::uniform_real_distribution<float> uniform(-2.0f, 2.0f);
    auto * values = static_cast<float *>(y->data);
    for (int64_t i = 0; i < ggml_nelements(y); ++i) values[i] = uniform(rng) * (outliers && rng() % outliers == 0 ? 40.0f : 1.0f);
    if (y->ne[1] > 1) {
        std::fill_n(values, y->ne[0], 0.0f);
    }
}

}  // namespace dflash2
