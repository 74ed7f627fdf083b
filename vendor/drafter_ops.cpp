// Small ops of the DFlash drafter graph that ggml runs element by element.
//
// The bundled llama.cpp's DFlash graph (src/models/dflash.cpp) spends a large share of a drafter call
// in ops that move no arithmetic (BENCHMARKS.md (e), (n)):
// - a fill: a reduced-vocabulary drafter's logits are scattered into full-vocabulary rows made by
//   ggml_fill(ggml_new_tensor_3d(F32, 1, n_vocab, n_outputs), -INFINITY), a tensor whose rows are one
//   element wide, which ggml fills row by row with index arithmetic and a call per row (786k turns for
//   a block of 16 over SmolLM2's 49,152 tokens, 30% of a call);
// - a top-k over those full rows, which ggml runs as a partial sort of all 49,152 indices although
//   all but the 8,192 draft tokens are -inf;
// - pads of the selector's rows to the embedding width, which ggml writes element by element with
//   the outermost dimension innermost.
// These kernels give the same values: the fill writes the same constant over each thread's share of
// the contiguous tensor; the pad copies the rows and writes the same zeros; the top-k runs the same
// partial sort (the same standard library's) over the indices that can enter it (the first k, then
// those whose value exceeds -inf: no other ever passes the sort's test against the heap), so it
// takes the same steps and returns the same indices in the same order. They plug in as one of ggml's
// CPU "extra buffer types" (vendor/cpu_extra.h).

#include "dflash2_shim.h"
#include "cpu_extra.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// f32 fills of contiguous tensors with rows under 16 wide, where ggml's per-row overhead dominates.
bool narrow_fill(const ggml_tensor * op) {
    return op->op == GGML_OP_FILL && op->type == GGML_TYPE_F32 && op->ne[0] < 16 && ggml_is_contiguous(op);
}

// f32 zero pads (not circular) into a contiguous tensor from rows of contiguous elements.
bool zero_pad(const ggml_tensor * op) {
    const ggml_tensor * src = op->src[0];
    return op->op == GGML_OP_PAD && op->type == GGML_TYPE_F32 && src && src->type == GGML_TYPE_F32 &&
           src->nb[0] == sizeof(float) && ggml_is_contiguous(op) && op->op_params[8] == 0;
}

// f32 top-k over rows of a vocabulary's width (the drafter's candidates).
bool wide_top_k(const ggml_tensor * op) {
    const ggml_tensor * src = op->src[0];
    return op->op == GGML_OP_TOP_K && op->type == GGML_TYPE_I32 && src && src->type == GGML_TYPE_F32 &&
           src->ne[0] >= 1024 && op->nb[0] == sizeof(int32_t) && src->nb[0] == sizeof(float);
}

// Per thread, the top-k's candidate indices (as ggml's own buffer holds its indices).
size_t top_k_scratch(const ggml_tensor * op) { return size_t(op->src[0]->ne[0] + 16); }

void fill(const ggml_compute_params * params, ggml_tensor * op) {
    float value;
    std::memcpy(&value, op->op_params, sizeof(value));  // ggml_fill's constant
    const int64_t n = ggml_nelements(op);
    float * data = static_cast<float *>(op->data);
    std::fill(data + n * params->ith / params->nth, data + n * (params->ith + 1) / params->nth, value);
}

void pad(const ggml_compute_params * params, ggml_tensor * op) {
    const ggml_tensor * src = op->src[0];
    const int32_t * p = op->op_params;  // left / right pads of each dimension
    const int64_t ne0 = op->ne[0], ne1 = op->ne[1], ne2 = op->ne[2];
    const int64_t rows = ne1 * ne2 * op->ne[3];
    float * data = static_cast<float *>(op->data);
    for (int64_t r = rows * params->ith / params->nth; r < rows * (params->ith + 1) / params->nth; ++r) {
        const int64_t i1 = r % ne1, i2 = (r / ne1) % ne2, i3 = r / (ne1 * ne2);
        float * row = data + r * ne0;
        const bool inside = i1 >= p[2] && i1 < ne1 - p[3] && i2 >= p[4] && i2 < ne2 - p[5] && i3 >= p[6] && i3 < op->ne[3] - p[7];
        if (!inside) {
            std::fill(row, row + ne0, 0.0f);
            continue;
        }
        const char * from = (const char *) src->data + (i3 - p[6]) * src->nb[3] + (i2 - p[4]) * src->nb[2] + (i1 - p[2]) * src->nb[1];
        std::fill(row, row + p[0], 0.0f);
        std::memcpy(row + p[0], from, size_t(ne0 - p[0] - p[1]) * sizeof(float));
        std::fill(row + ne0 - p[1], row + ne0, 0.0f);
    }
}

void top_k(const ggml_compute_params * params, ggml_tensor * op) {
    const ggml_tensor * src = op->src[0];
    const int64_t n = src->ne[0], rows = ggml_nrows(src);
    const int k = (int) op->ne[0];
    int32_t * idx = static_cast<int32_t *>(params->wdata) + top_k_scratch(op) * params->ith;
    for (int64_t i = params->ith; i < rows; i += params->nth) {
        const float * row = (const float *) ((const char *) src->data + i * src->nb[1]);
        int64_t len = 0;
        for (int32_t j = 0; j < k; ++j) idx[len++] = j;
        int64_t j = k;
#if defined(__AVX512F__)
        const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
        __m512i lanes = _mm512_add_epi32(_mm512_set1_epi32((int32_t) j), _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
        for (; j + 16 <= n; j += 16) {
            const __mmask16 above = _mm512_cmp_ps_mask(_mm512_loadu_ps(row + j), neg_inf, _CMP_GT_OQ);
            _mm512_mask_compressstoreu_epi32(idx + len, above, lanes);
            len += __builtin_popcount(above);
            lanes = _mm512_add_epi32(lanes, _mm512_set1_epi32(16));
        }
#endif
        for (; j < n; ++j) {
            if (row[j] > -INFINITY) {
                idx[len++] = (int32_t) j;
            }
        }
        // ggml's comparison: the larger value first
        std::partial_sort(idx, idx + k, idx + len, [row](int32_t a, int32_t b) { return row[a] > row[b]; });
        int32_t * out = (int32_t *) ((char *) op->data + i * op->nb[1]);
        std::copy(idx, idx + k, out);
        if (k > 1) {
            std::swap(out[0], out[1]);  // as ggml does ("the order is not important")
        }
    }
}

class drafter_ops_traits : public ggml::cpu::tensor_traits {
  public:
    static bool takes(const ggml_tensor * op) { return narrow_fill(op) || zero_pad(op) || wide_top_k(op); }

    bool work_size(int n_threads, const ggml_tensor * op, size_t & size) override {
        size = op->op == GGML_OP_TOP_K ? top_k_scratch(op) * sizeof(int32_t) * n_threads : 0;
        return true;
    }

    bool compute_forward(ggml_compute_params * params, ggml_tensor * op) override {
        switch (op->op) {
            case GGML_OP_FILL: fill(params, op); break;
            case GGML_OP_PAD: pad(params, op); break;
            default: top_k(params, op); break;
        }
        return true;
    }
};

dflash2::op_kernel<drafter_ops_traits> kernel;

}  // namespace

extern "C" int32_t dflash2_set_drafter_ops(bool on) {
    return kernel.set(on, "DFLASH2_DRAFTER_OPS");
}
