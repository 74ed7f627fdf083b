// A DFlash 2 drafter's convolutions as one op each.
//
// The bundled llama.cpp builds each of a DFlash 2 layer's four convolutions (src/models/dflash.cpp,
// build_dflash2_conv) from 17 small ops: a copy of the side's coefficients, their repeat over each
// group of 16, the add of the learned base, and per tap (4) a copy of the tap's weights, a zero pad
// that shifts the block's rows (taps 1-3), a multiply and an add (taps 1-3). On 2 threads every op
// ends in a barrier that both threads wait at: 136 of a SmolLM2 drafter's block decode are its 8
// convolutions' (BENCHMARKS.md (q)).
//
// This kernel takes a convolution's last add (the op the graph names "*_conv_in-N" or
// "*_conv_out-N") where the ops that lead to it are exactly build_dflash2_conv's, and computes it
// from the per-tap weights (coefficient + base, which ggml's ops still compute) and the hidden rows
// with the same float operations in the same order: term = w * value (the value 0 where the pad
// puts it), sum = ((term_0 + term_1) + term_2) + term_3. ggml plans every graph before it computes
// it, asking each op's kernel for a work buffer: there the kernel marks the 13 ops between the
// weights and the add (the weights' per-tap copies, the pads, multiplies and adds) as not to be
// computed (GGML_TENSOR_FLAG_COMPUTE cleared: ggml's graph loop then skips them and their barriers;
// nothing else reads their outputs). The inputs stay as computed until the add: their last readers
// in ggml's plan were those 13 ops, and only they ran after them (an output convolution's hidden
// rows, the attention, come after its weights; the coefficients that the attention's memory may
// take are read before it). The add's own output must not share memory with the inputs. Switched
// off, the kernel still takes an add whose ops it marked (llama.cpp reuses a graph for decodes of
// the same shape), to give them back to ggml at the next plan.

#include "dflash2_shim.h"
#include "cpu_extra.h"

#include "ggml-backend.h"

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

namespace {

// A convolution found from its last add: where its inputs are and the ops it replaces.
struct conv {
    const ggml_tensor * hidden = nullptr;   // [H, T] f32 rows
    const ggml_tensor * weights = nullptr;  // [16, H / 16, K, T] f32: coefficient + base per tap
    int64_t H = 0, T = 0, block = 0, taps = 0;
    std::vector<ggml_tensor *> inner;       // the ops between those and the last add
};

// The tensor whose memory `t` is, through views and reshapes.
const ggml_tensor * owner(const ggml_tensor * t) { return t->view_src ? t->view_src : t; }

bool f32_rows(const ggml_tensor * t, int64_t ne0, int64_t ne1) {
    return t->type == GGML_TYPE_F32 && ggml_is_contiguous(t) && t->ne[0] == ne0 && t->ne[1] == ne1 && t->ne[2] == 1 && t->ne[3] == 1;
}

// Matches the ops of build_dflash2_conv ending in `root` (see above); false where anything differs.
bool match(const ggml_tensor * root, conv & c) {
    if (root->op != GGML_OP_ADD || !std::strstr(root->name, "_conv_") || !f32_rows(root, root->ne[0], root->ne[1])) {
        return false;
    }
    c = conv{};
    c.H = root->ne[0];
    c.T = root->ne[1];
    // sum = add(... add(term_0, term_1) ..., term_last)
    std::vector<const ggml_tensor *> terms;
    const ggml_tensor * node = root;
    while (node->op == GGML_OP_ADD) {
        if (!f32_rows(node, c.H, c.T) || node->src[1]->op != GGML_OP_MUL) {
            return false;
        }
        terms.insert(terms.begin(), node->src[1]);
        if (node != root) {
            c.inner.push_back(const_cast<ggml_tensor *>(node));
        }
        node = node->src[0];
    }
    if (node->op != GGML_OP_MUL) {
        return false;
    }
    terms.insert(terms.begin(), node);
    c.taps = (int64_t) terms.size();
    const ggml_tensor * weight_all = nullptr;
    for (int64_t tap = 0; tap < c.taps; ++tap) {
        const ggml_tensor * term = terms[size_t(tap)];
        if (!f32_rows(term, c.H, c.T)) {
            return false;
        }
        c.inner.push_back(const_cast<ggml_tensor *>(term));
        // the tap's weights: cont(view of weight_all at k = tap), reshaped to [H, T]
        const ggml_tensor * w = owner(term->src[0]);
        if (w->op != GGML_OP_CONT || w->src[0]->op != GGML_OP_VIEW || w->ne[2] != 1 || w->ne[3] != c.T) {
            return false;
        }
        const ggml_tensor * wall = owner(w->src[0]);
        if ((weight_all && wall != weight_all) || w->src[0]->view_offs != size_t(tap) * wall->nb[2] ||
            w->src[0]->nb[1] != wall->nb[1] || w->src[0]->nb[3] != wall->nb[3]) {
            return false;
        }
        weight_all = wall;
        c.inner.push_back(const_cast<ggml_tensor *>(w));
        // the tap's values: the hidden rows (tap 0), or their pad shifting each block by `tap` rows
        const ggml_tensor * v = term->src[1];
        if (v->view_offs != 0 || ggml_nelements(v) != c.H * c.T) {
            return false;
        }
        if (tap == 0) {
            c.hidden = owner(v);
        } else {
            // pad(view of each block's first rows, `tap` zero rows in front)
            const ggml_tensor * pad = owner(v);
            const ggml_tensor * rows = pad->src[0];
            if (pad->op != GGML_OP_PAD || owner(rows) != c.hidden || ggml_get_op_params_i32(pad, 2) != tap ||
                ggml_get_op_params_i32(pad, 8) != 0 || rows->view_offs != 0 || rows->ne[1] != pad->ne[1] - tap ||
                rows->nb[1] != c.hidden->nb[1] || rows->nb[2] != pad->ne[1] * c.hidden->nb[1]) {
                return false;
            }
            for (int p : { 0, 1, 3, 4, 5, 6, 7 }) {
                if (ggml_get_op_params_i32(pad, p) != 0) {
                    return false;
                }
            }
            if (tap == 1) {
                c.block = pad->ne[1];
            } else if (pad->ne[1] != c.block) {
                return false;
            }
            c.inner.push_back(const_cast<ggml_tensor *>(pad));
        }
    }
    if (c.taps == 1) {
        c.block = c.T;  // tap 0 alone reads no other row
    }
    // weight_all = add(repeat(cont(this side's coefficients)), this side's base)
    if (!weight_all || weight_all->op != GGML_OP_ADD || weight_all->type != GGML_TYPE_F32 || !ggml_is_contiguous(weight_all)) {
        return false;
    }
    const int64_t S = weight_all->ne[0], G = weight_all->ne[1], K = weight_all->ne[2];
    const ggml_tensor * rep = weight_all->src[0];
    const ggml_tensor * coeffs = rep->op == GGML_OP_REPEAT ? owner(rep->src[0]) : nullptr;
    const ggml_tensor * base_view = weight_all->src[1];
    const ggml_tensor * base = owner(base_view);
    if (!coeffs || coeffs->op != GGML_OP_CONT || coeffs->src[0]->op != GGML_OP_VIEW || base->type != GGML_TYPE_F32 ||
        !ggml_is_contiguous(base) || base_view->ne[0] != S || base_view->ne[1] != G || base_view->ne[2] != K ||
        base_view->ne[3] != 1 || !ggml_is_contiguous(base_view) || weight_all->ne[3] != c.T || rep->ne[3] != c.T ||
        coeffs->ne[0] != G || coeffs->ne[1] != K || coeffs->ne[2] != c.T) {
        return false;
    }
    const ggml_tensor * dynamic = owner(coeffs->src[0]);
    const size_t coeff_offset = coeffs->src[0]->view_offs;
    if (!f32_rows(dynamic, dynamic->ne[0], c.T) || coeff_offset % sizeof(float) != 0 ||
        int64_t(coeff_offset / sizeof(float)) + K * G > dynamic->ne[0] || coeffs->src[0]->nb[1] != sizeof(float) * G ||
        coeffs->src[0]->nb[2] != dynamic->nb[1]) {
        return false;
    }
    if (S * G != c.H || c.taps > K || c.block <= 0 || c.T % c.block != 0 || !f32_rows(c.hidden, c.H, c.T)) {
        return false;
    }
    // The weights (the coefficients' copy and repeat, the base's add) stay ggml's to compute: the
    // convolution reads them, and ops outside it may run between them and the last add (the
    // attention an output convolution reads), in memory that the coefficients' last reader freed.
    c.weights = weight_all;
    return true;
}

// Output rows [t0, t1) of the convolution into `out` (rows of H), as ggml's ops round them (each
// product rounded before its add: no fused multiply-add).
__attribute__((optimize("fp-contract=off"))) void convolve(const conv & c, int64_t t0, int64_t t1, float * out, size_t out_stride) {
    for (int64_t t = t0; t < t1; ++t) {
        float * o = (float *) ((char *) out + t * out_stride);
        const int64_t j = t % c.block;  // the row's place in its block
        for (int64_t tap = 0; tap < c.taps; ++tap) {
            const float * w = (const float *) ((const char *) c.weights->data + t * c.weights->nb[3] + tap * c.weights->nb[2]);
            const float * v = j >= tap ? (const float *) ((const char *) c.hidden->data + (t - tap) * c.hidden->nb[1]) : nullptr;
            for (int64_t h = 0; h < c.H; ++h) {
                const float term = w[h] * (v ? v[h] : 0.0f);
                o[h] = tap == 0 ? term : o[h] + term;
            }
        }
    }
}

bool overlaps(const ggml_tensor * a, const ggml_tensor * b) {
    const char * a0 = (const char *) a->data;
    const char * b0 = (const char *) b->data;
    return a0 < b0 + ggml_nbytes(b) && b0 < a0 + ggml_nbytes(a);
}

// In the CPU's memory (no buffer: a plain ggml context's).
bool host(const ggml_tensor * t) { return !t->buffer || ggml_backend_buffer_is_host(t->buffer); }

bool marked(const conv & c) {
    for (const ggml_tensor * t : c.inner) {
        if (t->flags & GGML_TENSOR_FLAG_COMPUTE) {
            return false;
        }
    }
    return true;
}

bool kernel_on();

std::atomic<int64_t> computed{ 0 };  // convolutions the kernel computed in this process

class conv_traits : public ggml::cpu::tensor_traits {
  public:
    static bool takes(const ggml_tensor * op) {
        conv c;
        return match(op, c) && host(op) && host(c.hidden) && host(c.weights) && !overlaps(op, c.hidden) && !overlaps(op, c.weights);
    }

    // Off, the kernel still takes an add whose ops it marked, to give them back.
    static bool takes_when_off(const ggml_tensor * op) {
        conv c;
        return match(op, c) && marked(c);
    }

    // ggml plans a graph (one thread, every op in order) before each decode computes it: the
    // kernel marks a convolution's ops there while it is on, and unmarks them while it is off.
    bool work_size(int, const ggml_tensor * op, size_t &) override {
        conv c;
        if (match(op, c)) {
            const bool on = kernel_on();
            for (ggml_tensor * t : c.inner) t->flags = on ? t->flags & ~GGML_TENSOR_FLAG_COMPUTE : t->flags | GGML_TENSOR_FLAG_COMPUTE;
        }
        return false;  // no buffer
    }

    bool compute_forward(ggml_compute_params * params, ggml_tensor * op) override {
        conv c;
        if (params->use_ref || !match(op, c) || !marked(c)) {
            return false;
        }
        convolve(c, c.T * params->ith / params->nth, c.T * (params->ith + 1) / params->nth, (float *) op->data, op->nb[1]);
        computed += params->ith == 0;
        return true;
    }
};

dflash2::op_kernel<conv_traits> kernel{ "DFLASH2_DRAFTER_CONV" };

bool kernel_on() { return kernel.on(); }

// A convolution built as build_dflash2_conv builds it (hidden [H, T] in blocks of `block`, the
// projected coefficients of both sides, the base [H, K, 2]), of random inputs.
ggml_tensor * random_conv(ggml_context * ctx, std::mt19937 & rng, int64_t H, int64_t S, int64_t K, int64_t block, int64_t blocks,
                          int side, float zero_share) {
    std::uniform_real_distribution<float> uniform(-2.0f, 2.0f);
    const int64_t T = block * blocks, G = H / S;
    auto random = [&](ggml_tensor * t) {
        for (int64_t i = 0; i < ggml_nelements(t); ++i) ((float *) t->data)[i] = uniform(rng) < 4 * zero_share - 2 ? 0.0f : uniform(rng);
        return t;
    };
    ggml_tensor * hidden = random(ggml_new_tensor_2d(ctx, GGML_TYPE_F32, H, T));
    ggml_tensor * dynamic = random(ggml_new_tensor_2d(ctx, GGML_TYPE_F32, 2 * K * G, T));
    ggml_tensor * base = random(ggml_new_tensor_3d(ctx, GGML_TYPE_F32, H, K, 2));
    // the hidden rows as the graph's ops produce them (a scale), so that they are computed
    hidden = ggml_scale(ctx, hidden, 1.0f);
    dynamic = ggml_scale(ctx, dynamic, 1.0f);

    ggml_tensor * rows = ggml_reshape_3d(ctx, hidden, H, block, blocks);
    ggml_tensor * coeffs = ggml_reshape_4d(ctx, dynamic, G, K, 2, T);
    ggml_tensor * side_coeffs = ggml_view_3d(ctx, coeffs, G, K, T, coeffs->nb[1], coeffs->nb[3], side * coeffs->nb[2]);
    ggml_tensor * all = ggml_reshape_4d(ctx, ggml_cont(ctx, side_coeffs), 1, G, K, T);
    all = ggml_repeat_4d(ctx, all, S, G, K, T);
    ggml_tensor * side_base = ggml_reshape_4d(ctx, ggml_view_1d(ctx, base, H * K, side * base->nb[2]), S, G, K, 1);
    ggml_tensor * weights = ggml_add(ctx, all, side_base);
    ggml_tensor * sum = nullptr;
    for (int64_t tap = 0; tap < std::min(K, block); ++tap) {
        ggml_tensor * values = rows;
        if (tap > 0) {
            values = ggml_pad_ext(ctx, ggml_view_3d(ctx, rows, H, block - tap, blocks, rows->nb[1], rows->nb[2], 0), 0, 0, (int) tap, 0, 0, 0,
                                  0, 0);
        }
        values = ggml_reshape_2d(ctx, values, H, T);
        ggml_tensor * w = ggml_reshape_2d(
            ctx, ggml_cont(ctx, ggml_view_4d(ctx, weights, S, G, 1, T, weights->nb[1], weights->nb[2], weights->nb[3], tap * weights->nb[2])), H,
            T);
        ggml_tensor * term = ggml_mul(ctx, w, values);
        sum = sum ? ggml_add(ctx, sum, term) : term;
    }
    ggml_format_name(sum, "%s_conv_%s-0", side ? "ffn" : "attn", side ? "out" : "in");
    return sum;
}

// Each convolution of random inputs (SmolLM2's drafter's shapes, and others; some inputs zero)
// computed by ggml, then by the kernel twice over the same graph, then by ggml again with the kernel
// switched off (the ops given back): the outputs that differ in any bit from ggml's first. -2 where
// the kernel did not mark the ops while on, or did not give them back when off.
int64_t differences(std::mt19937 & rng, int n_threads) {
    int64_t differing = 0;
    struct shape {
        int64_t H, S, K, block, blocks;
    };
    for (const shape & s : { shape{ 576, 16, 4, 8, 1 }, shape{ 576, 16, 4, 2, 1 }, shape{ 576, 16, 4, 16, 2 }, shape{ 64, 16, 3, 5, 3 },
                             shape{ 32, 8, 4, 3, 2 } })
        for (int side : { 0, 1 }) {
            ggml_init_params init = { size_t(16) << 20, nullptr, false };
            ggml_context * ctx = ggml_init(init);
            if (!ctx) {
                return -3;
            }
            ggml_tensor * out = random_conv(ctx, rng, s.H, s.S, s.K, s.block, s.blocks, side, 0.1f);
            ggml_cgraph * graph = ggml_new_graph(ctx);
            ggml_build_forward_expand(graph, out);
            conv c;
            if (!match(out, c)) {
                ggml_free(ctx);
                return -2;
            }
            const bool was_on = kernel.on();
            const size_t bytes = ggml_nbytes(out);
            kernel.set(false);
            ggml_graph_compute_with_ctx(ctx, graph, n_threads);
            std::vector<char> ggmls((const char *) out->data, (const char *) out->data + bytes);
            auto count = [&]() {
                for (size_t i = 0; i < bytes; i += sizeof(float)) differing += std::memcmp(ggmls.data() + i, (const char *) out->data + i, sizeof(float)) != 0;
                std::memset(out->data, 0x7f, bytes);  // NaNs where an output is left unwritten
            };
            std::memset(out->data, 0x7f, bytes);
            bool steps_right = true;
            for (int pass = 0; pass < 3; ++pass) {
                kernel.set(pass < 2);
                ggml_graph_compute_with_ctx(ctx, graph, n_threads);
                count();
                steps_right = steps_right && marked(c) == (pass < 2);
            }
            kernel.set(was_on);
            ggml_free(ctx);
            if (!steps_right) {
                return -2;
            }
        }
    return differing;
}

}  // namespace

extern "C" int32_t dflash2_set_drafter_conv(bool on) { return kernel.set(on); }

extern "C" int64_t dflash2_drafter_conv_computed(void) { return computed.load(); }

extern "C" int64_t dflash2_drafter_conv_differences(uint32_t seed, int32_t n_threads) {
    try {
        std::mt19937 rng(seed);
        return differences(rng, n_threads);
    } catch (...) {
        return -3;
    }
}
