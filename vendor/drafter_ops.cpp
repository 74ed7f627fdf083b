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
//   the outermost dimension innermost;
// - the scatter of the draft logits into those rows (a set_rows of rows one element wide: a call of
//   ggml's f32 copy per logit);
// - the DFlash 2 convolutions' repeats of one coefficient per group of 16 (a copy call per value, on
//   one thread) and their adds and multiplies of rows 16 wide (ggml's index arithmetic per row).
// These kernels give the same values: the fill writes the same constant over each thread's share of
// the contiguous tensor; the pad copies the rows and writes the same zeros; the top-k runs the same
// partial sort (the same standard library's) over the indices that can enter it (the first k, then
// those whose value exceeds -inf: no other ever passes the sort's test against the heap), so it
// takes the same steps and returns the same indices in the same order, and where the k largest
// values and the next are distinct (the drafter's logits nearly always) it returns them largest
// first without sorting, the only order ggml's sort can give them in; the scatter and the repeats
// copy the same values to the same places; the adds and multiplies round each sum or product once, as
// ggml's do, over runs as long as the broadcast allows. They plug in as one of ggml's CPU "extra buffer
// types" (vendor/cpu_extra.h).

#include "dflash2_shim.h"
#include "cpu_extra.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

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

// f32 set_rows of rows under 16 wide (the scatter of a reduced vocabulary's logits), I64 or I32 indices.
bool narrow_set_rows(const ggml_tensor * op) {
    const ggml_tensor * src = op->src[0];
    const ggml_tensor * idx = op->src[1];
    return op->op == GGML_OP_SET_ROWS && op->type == GGML_TYPE_F32 && src && src->type == GGML_TYPE_F32 && idx &&
           (idx->type == GGML_TYPE_I64 || idx->type == GGML_TYPE_I32) && src->ne[0] < 16 && src->nb[0] == sizeof(float) &&
           op->nb[0] == sizeof(float);
}

// f32 repeats from rows of contiguous elements into a contiguous tensor.
bool f32_repeat(const ggml_tensor * op) {
    const ggml_tensor * src = op->src[0];
    return op->op == GGML_OP_REPEAT && op->type == GGML_TYPE_F32 && src && src->type == GGML_TYPE_F32 &&
           src->nb[0] == sizeof(float) && ggml_is_contiguous(op);
}

// How many leading dimensions of a binary op's src1 match dst's (0 where src1's rows are not whole,
// or an operand is not contiguous): runs over those dimensions are contiguous in all three operands.
int binary_dims(const ggml_tensor * op) {
    const ggml_tensor * a = op->src[0];
    const ggml_tensor * b = op->src[1];
    if (!ggml_is_contiguous(op) || !ggml_is_contiguous(a) || !ggml_is_contiguous(b)) {
        return 0;
    }
    int d = 0;
    while (d < GGML_MAX_DIMS && b->ne[d] == op->ne[d]) ++d;
    return d;
}

// f32 adds and multiplies of contiguous operands whose rows are narrow (under 64 wide) or broadcast
// (src1 repeated over an outer dimension), where ggml's per-row index arithmetic dominates.
bool small_binary(const ggml_tensor * op) {
    const ggml_tensor * a = op->src[0];
    const ggml_tensor * b = op->src[1];
    if (!(op->op == GGML_OP_ADD || op->op == GGML_OP_MUL) || op->type != GGML_TYPE_F32 || !a || !b ||
        a->type != GGML_TYPE_F32 || b->type != GGML_TYPE_F32 || !ggml_are_same_shape(a, op)) {
        return false;
    }
    const int dims = binary_dims(op);
    return dims > 0 && (op->ne[0] < 64 || dims < GGML_MAX_DIMS);
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

// ggml's split: each thread a run of the source rows, over every plane.
template <typename idx_t> void set_rows(const ggml_compute_params * params, ggml_tensor * op) {
    const ggml_tensor * src = op->src[0];
    const ggml_tensor * idx = op->src[1];
    const int64_t nc = src->ne[0], nr = src->ne[1];
    const int64_t dr = (nr + params->nth - 1) / params->nth;
    const int64_t ir0 = dr * params->ith, ir1 = std::min(ir0 + dr, nr);
    for (int64_t i03 = 0; i03 < src->ne[3]; ++i03) {
        for (int64_t i02 = 0; i02 < src->ne[2]; ++i02) {
            const char * rows = (const char *) idx->data + (i02 % idx->ne[1]) * idx->nb[1] + (i03 % idx->ne[2]) * idx->nb[2];
            const char * from = (const char *) src->data + i02 * src->nb[2] + i03 * src->nb[3];
            char * to = (char *) op->data + i02 * op->nb[2] + i03 * op->nb[3];
            for (int64_t i = ir0; i < ir1; ++i) {
                const int64_t i1 = *(const idx_t *) (rows + i * idx->nb[0]);
                GGML_ASSERT(i1 >= 0 && i1 < op->ne[1]);
                const float * x = (const float *) (from + i * src->nb[1]);
                float * y = (float *) (to + i1 * op->nb[1]);
                if (nc == 1) {
                    *y = *x;  // a logit (no call of a copy routine per value)
                } else {
                    std::copy(x, x + nc, y);
                }
            }
        }
    }
}

void repeat(const ggml_compute_params * params, ggml_tensor * op) {
    const ggml_tensor * src = op->src[0];
    const int64_t ne0 = op->ne[0], ne1 = op->ne[1], ne2 = op->ne[2];
    const int64_t width = src->ne[0], rows = ggml_nrows(op);
    const int64_t r0 = rows * params->ith / params->nth, r1 = rows * (params->ith + 1) / params->nth;
    // the row's indices in dst and (wrapping with them) in src, counted on rather than divided out
    int64_t i1 = r0 % ne1, i2 = (r0 / ne1) % ne2, i3 = r0 / (ne1 * ne2);
    int64_t j1 = i1 % src->ne[1], j2 = i2 % src->ne[2], j3 = i3 % src->ne[3];
    float * row = static_cast<float *>(op->data) + r0 * ne0;
    for (int64_t r = r0; r < r1; ++r, row += ne0) {
        const float * from = (const float *) ((const char *) src->data + j1 * src->nb[1] + j2 * src->nb[2] + j3 * src->nb[3]);
        if (width == 1) {
            std::fill(row, row + ne0, from[0]);
        } else {
            for (int64_t i0 = 0; i0 < ne0; i0 += width) std::copy(from, from + width, row + i0);
        }
        if (++j1 == src->ne[1]) j1 = 0;
        if (++i1 == ne1) {
            i1 = j1 = 0;
            if (++j2 == src->ne[2]) j2 = 0;
            if (++i2 == ne2) {
                i2 = j2 = 0;
                if (++j3 == src->ne[3]) j3 = 0;
                ++i3;
            }
        }
    }
}

// The operands as runs over binary_dims(op) dimensions: dst and src0 run on, src1 restarts where it
// broadcasts. Each thread takes an even share of the elements.
template <bool add> void binary(const ggml_compute_params * params, ggml_tensor * op) {
    const ggml_tensor * b = op->src[1];
    const int dims = binary_dims(op);
    int64_t run = 1;
    for (int d = 0; d < dims; ++d) run *= op->ne[d];
    const int64_t n = ggml_nelements(op);
    const float * x = static_cast<const float *>(op->src[0]->data);
    float * out = static_cast<float *>(op->data);
    int64_t first = n * params->ith / params->nth;
    const int64_t last = n * (params->ith + 1) / params->nth;
    while (first < last) {
        // src1's run: the run's index in each outer dimension, modulo src1's extent there
        int64_t outer = first / run, offset = 0;
        for (int d = dims; d < GGML_MAX_DIMS; ++d) {
            offset += (outer % op->ne[d]) % b->ne[d] * int64_t(b->nb[d] / sizeof(float));
            outer /= op->ne[d];
        }
        const int64_t at = first % run, len = std::min(run - at, last - first);
        const float * y = static_cast<const float *>(b->data) + offset + at;
        const float * xs = x + first;
        float * o = out + first;
        if (add) {
            for (int64_t i = 0; i < len; ++i) o[i] = xs[i] + y[i];
        } else {
            for (int64_t i = 0; i < len; ++i) o[i] = xs[i] * y[i];
        }
        first += len;
    }
}

// ggml's own steps: its partial sort (the same standard library's) over the indices that can enter
// it, the first k, then those whose value exceeds -inf (no other ever passes the sort's test against
// the heap). `idx`: room for n + 16 indices.
void sorted_top_k(const float * row, int64_t n, int k, int32_t * idx, int32_t * out) {
    int64_t len = 0;
    for (int32_t j = 0; j < k; ++j) idx[len++] = j;
    int64_t j = k;
#if defined(__AVX512F__)
    const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
    __m512i lanes = _mm512_add_epi32(_mm512_set1_epi32((int32_t) j), _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    for (; j + 16 <= n; j += 16) {
        const __mmask16 above = _mm512_cmp_ps_mask(_mm512_loadu_ps(row + j), neg_inf, _CMP_GT_OQ);
        // compressed in a register, then stored whole (a compressing store is microcoded on AMD)
        _mm512_storeu_si512(idx + len, _mm512_maskz_compress_epi32(above, lanes));
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
    std::copy(idx, idx + k, out);
}

// The k largest values of a row, largest first, when they and the next one are all distinct: ggml's
// partial sort can then return only these, in this order, whatever the steps of its heap. False
// where values tie at or above the (k+1)-th largest, the row holds a NaN, fewer than k + 1 values
// exceed -inf or k is above MAX_DISTINCT_K: the caller then sorts as ggml does.
constexpr int MAX_DISTINCT_K = 64;

bool distinct_top_k(const float * row, int64_t n, int k, int32_t * out) {
    if (k > MAX_DISTINCT_K) {
        return false;
    }
    float val[MAX_DISTINCT_K + 1];
    int32_t at[MAX_DISTINCT_K + 1];
    int kept = 0;
    float low = -INFINITY;  // the (k+1)-th largest so far: nothing at or below it can matter
    auto take = [&](int64_t j) {
        const float v = row[j];
        int p = kept < k + 1 ? kept : k;
        if (kept == k + 1 && !(v > val[k])) {
            return;
        }
        for (; p > 0 && val[p - 1] < v; --p) {
            val[p] = val[p - 1];
            at[p] = at[p - 1];
        }
        val[p] = v;
        at[p] = (int32_t) j;
        kept += kept < k + 1;
        if (kept == k + 1) {
            low = val[k];
        }
    };
    int64_t j = 0;
#if defined(__AVX512F__)
    for (; j + 16 <= n; j += 16) {
        const __m512 v = _mm512_loadu_ps(row + j);
        if (_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q)) {
            return false;
        }
        for (__mmask16 above = _mm512_cmp_ps_mask(v, _mm512_set1_ps(low), _CMP_GT_OQ); above; above &= above - 1) {
            take(j + __builtin_ctz(above));
        }
    }
#endif
    for (; j < n; ++j) {
        if (std::isnan(row[j])) {
            return false;
        }
        if (row[j] > low) {
            take(j);
        }
    }
    if (kept < k + 1) {
        return false;
    }
    for (int i = 0; i < k; ++i) {
        if (!(val[i] > val[i + 1])) {
            return false;
        }
    }
    std::copy(at, at + k, out);
    return true;
}

void top_k(const ggml_compute_params * params, ggml_tensor * op) {
    const ggml_tensor * src = op->src[0];
    const int64_t n = src->ne[0], rows = ggml_nrows(src);
    const int k = (int) op->ne[0];
    int32_t * idx = static_cast<int32_t *>(params->wdata) + top_k_scratch(op) * params->ith;
    for (int64_t i = params->ith; i < rows; i += params->nth) {
        const float * row = (const float *) ((const char *) src->data + i * src->nb[1]);
        int32_t * out = (int32_t *) ((char *) op->data + i * op->nb[1]);
        if (!distinct_top_k(row, n, k, out)) {
            sorted_top_k(row, n, k, idx, out);
        }
        if (k > 1) {
            std::swap(out[0], out[1]);  // as ggml does ("the order is not important")
        }
    }
}

class drafter_ops_traits : public ggml::cpu::tensor_traits {
  public:
    static bool takes(const ggml_tensor * op) {
        return narrow_fill(op) || zero_pad(op) || wide_top_k(op) || narrow_set_rows(op) || f32_repeat(op) || small_binary(op);
    }

    bool work_size(int n_threads, const ggml_tensor * op, size_t & size) override {
        size = op->op == GGML_OP_TOP_K ? top_k_scratch(op) * sizeof(int32_t) * n_threads : 0;
        return true;
    }

    bool compute_forward(ggml_compute_params * params, ggml_tensor * op) override {
        switch (op->op) {
            case GGML_OP_FILL: fill(params, op); break;
            case GGML_OP_PAD: pad(params, op); break;
            case GGML_OP_SET_ROWS:
                if (op->src[1]->type == GGML_TYPE_I64) {
                    set_rows<int64_t>(params, op);
                } else {
                    set_rows<int32_t>(params, op);
                }
                break;
            case GGML_OP_REPEAT: repeat(params, op); break;
            case GGML_OP_ADD: binary<true>(params, op); break;
            case GGML_OP_MUL: binary<false>(params, op); break;
            default: top_k(params, op); break;
        }
        return true;
    }
};

dflash2::op_kernel<drafter_ops_traits> kernel{ "DFLASH2_DRAFTER_OPS" };

// Each op the kernels take, in the drafter graph's shapes and in others, on random inputs, through
// ggml's kernels and through these.
int64_t differences(std::mt19937 & rng, int n_threads) {
    ggml_init_params init = { size_t(64) << 20, nullptr, false };
    ggml_context * ctx = ggml_init(init);
    if (!ctx) {
        return -3;
    }
    std::uniform_real_distribution<float> uniform(-2.0f, 2.0f);
    auto random = [&](int64_t ne0, int64_t ne1, int64_t ne2 = 1, int64_t ne3 = 1) {
        ggml_tensor * t = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, ne0, ne1, ne2, ne3);
        for (int64_t i = 0; i < ggml_nelements(t); ++i) ((float *) t->data)[i] = uniform(rng);
        return t;
    };
    // 0..n-1 in a random order
    auto shuffled = [&](int64_t n) {
        std::vector<int64_t> order(static_cast<size_t>(n));
        std::iota(order.begin(), order.end(), 0);
        std::shuffle(order.begin(), order.end(), rng);
        return order;
    };
    // distinct row indices (a permutation's head), n per plane over `planes` planes
    auto rows = [&](ggml_type type, int64_t n, int64_t of, int64_t planes) {
        ggml_tensor * t = ggml_new_tensor_2d(ctx, type, n, planes);
        for (int64_t p = 0; p < planes; ++p) {
            const std::vector<int64_t> order = shuffled(of);
            for (int64_t i = 0; i < n; ++i) {
                if (type == GGML_TYPE_I64) {
                    ((int64_t *) t->data)[p * n + i] = order[size_t(i)];
                } else {
                    ((int32_t *) t->data)[p * n + i] = (int32_t) order[size_t(i)];
                }
            }
        }
        return t;
    };
    // a vocabulary-wide row set, finite at `finite` random places per row, -inf elsewhere
    auto sparse = [&](int64_t width, int64_t n_rows, int64_t finite) {
        ggml_tensor * t = random(width, n_rows);
        for (int64_t r = 0; r < n_rows; ++r) {
            const std::vector<int64_t> order = shuffled(width);
            for (int64_t i = finite; i < width; ++i) ((float *) t->data)[r * width + order[size_t(i)]] = -INFINITY;
        }
        return t;
    };
    // the same rows with their values rounded to halves (many equal values)
    auto coarse = [&](ggml_tensor * t) {
        for (int64_t i = 0; i < ggml_nelements(t); ++i) ((float *) t->data)[i] = std::round(((float *) t->data)[i] * 2.0f) / 2.0f;
        return t;
    };
    const int64_t vocab = 49152, draft = 8192;
    ggml_tensor * cases[] = {
        ggml_fill(ctx, ggml_new_tensor_3d(ctx, GGML_TYPE_F32, 1, vocab, 3), -INFINITY),
        // the draft logits' scatter, as the DFlash graph builds it
        ggml_set_rows(ctx, ggml_fill(ctx, ggml_new_tensor_3d(ctx, GGML_TYPE_F32, 1, vocab, 5), -INFINITY),
                      random(1, draft, 5), ggml_reshape_3d(ctx, rows(GGML_TYPE_I64, draft, vocab, 1), draft, 1, 1)),
        // (into a copy the graph makes afresh: set_rows writes in place)
        ggml_set_rows(ctx, ggml_dup(ctx, random(3, 100, 2)), random(3, 40, 2), rows(GGML_TYPE_I32, 40, 100, 2)),
        ggml_top_k(ctx, sparse(vocab, 3, draft), 16),
        ggml_top_k(ctx, sparse(2048, 2, 2048), 16),
        ggml_top_k(ctx, sparse(1500, 2, 5), 16),
        ggml_top_k(ctx, coarse(sparse(vocab, 4, draft)), 16),  // ties at the top: ggml's sort decides
        ggml_top_k(ctx, sparse(4096, 2, 4096), 80),
        ggml_pad_ext(ctx, random(576, 7), 0, 0, 1, 0, 0, 0, 0, 0),
        ggml_pad(ctx, random(272, 3, 2), 576 - 272, 0, 0, 0),
        ggml_repeat_4d(ctx, random(1, 36, 4, 8), 16, 36, 4, 8),
        ggml_repeat(ctx, random(3, 2, 1, 2), ggml_new_tensor_4d(ctx, GGML_TYPE_F32, 12, 4, 3, 2)),
        ggml_add(ctx, random(16, 36, 4, 8), random(16, 36, 4, 1)),
        ggml_mul(ctx, random(64, 9, 8), random(64, 1, 1)),
        ggml_add(ctx, random(16, 3, 5, 2), random(16, 3, 1, 2)),
        ggml_add(ctx, random(16, 3, 4, 2), random(16, 3, 2, 1)),
        ggml_mul(ctx, random(16, 4, 3), random(16, 4, 3)),
    };
    int64_t differing = 0;
    for (ggml_tensor * out : cases) {
        const int64_t d = kernel.differences(ctx, out, n_threads);
        if (d < 0) {
            differing = d;
            break;
        }
        differing += d;
    }
    ggml_free(ctx);
    return differing;
}

}  // namespace

extern "C" int32_t dflash2_set_drafter_ops(bool on) {
    return kernel.set(on);
}

extern "C" int64_t dflash2_drafter_ops_differences(uint32_t seed, int32_t n_threads) {
    try {
        std::mt19937 rng(seed);
        return differences(rng, n_threads);
    } catch (...) {
        return -3;
    }
}
