// Fills of contiguous tensors with narrow rows.
//
// The bundled llama.cpp's DFlash graph (src/models/dflash.cpp) scatters a drafter's reduced-vocabulary
// logits into full-vocabulary rows made by ggml_fill(ggml_new_tensor_3d(F32, 1, n_vocab, n_outputs),
// -INFINITY): a tensor whose rows are one element wide. ggml's CPU fill runs row by row, with index
// arithmetic and a call for each row: 786k turns for a block of 16 rows over SmolLM2's 49,152
// tokens, 30% of a drafter call (BENCHMARKS.md (e)). A contiguous tensor is one run of memory, so
// this kernel writes the value over each thread's share of it. The values are the same constant, so
// nothing anyone reads changes. It plugs in as one of ggml's CPU "extra buffer types"
// (vendor/cpu_extra.h) and takes f32 fills of contiguous tensors with rows under 16 elements,
// where ggml's per-row overhead dominates; ggml keeps every other fill.

#include "dflash2_shim.h"
#include "cpu_extra.h"

#include <algorithm>
#include <cstring>

namespace {

class narrow_fill_traits : public ggml::cpu::tensor_traits {
  public:
    static bool takes(const ggml_tensor * op) {
        return op->op == GGML_OP_FILL && op->type == GGML_TYPE_F32 && op->ne[0] < 16 && ggml_is_contiguous(op);
    }

    bool work_size(int, const ggml_tensor *, size_t & size) override {
        size = 0;
        return true;
    }

    bool compute_forward(ggml_compute_params * params, ggml_tensor * op) override {
        float value;
        std::memcpy(&value, op->op_params, sizeof(value));  // ggml_fill's constant
        const int64_t n = ggml_nelements(op);
        const int64_t first = n * params->ith / params->nth;
        const int64_t last = n * (params->ith + 1) / params->nth;
        std::fill(static_cast<float *>(op->data) + first, static_cast<float *>(op->data) + last, value);
        return true;
    }
};

dflash2::op_kernel<narrow_fill_traits> kernel;

}  // namespace

extern "C" int32_t dflash2_set_narrow_fill(bool on) {
    return kernel.set(on, "DFLASH2_NARROW_FILL");
}
