// Re-exports llama.cpp's staging DFlash API with C linkage and implements the
// layer-input capture callback. No C++ exception may leave these functions.
#include "dflash2_shim.h"

#include "ggml-backend.h"
#include "ggml.h"
#include "llama-context.h"
#include "llama-ext.h"
#include "llama-model.h"
#include "common.h"
#include "log.h"
#include "speculative.h"

#include <algorithm>

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

extern "C" {

void dflash2_set_embeddings_layer_inp(llama_context * ctx, uint32_t layer, bool value) {
    llama_set_embeddings_layer_inp(ctx, layer, value);
}

const float * dflash2_get_embeddings_layer_inp(llama_context * ctx, uint32_t layer) {
    try {
        return llama_get_embeddings_layer_inp(ctx, layer);
    } catch (...) {
        return nullptr;
    }
}

void dflash2_set_embeddings_nextn(llama_context * ctx, bool value, bool masked) {
    llama_set_embeddings_nextn(ctx, value, masked);
}

const float * dflash2_get_embeddings_nextn(llama_context * ctx) {
    try {
        return llama_get_embeddings_nextn(ctx);
    } catch (...) {
        return nullptr;
    }
}

int64_t dflash2_adopt_drafter_weights(const llama_model * model, bool adopt) {
    try {
        int64_t n = 0;
        for (const auto & named : model->tensors_by_name) {
            const ggml_tensor * t = named.second;
            if (t->type == GGML_TYPE_Q8_0 && ggml_n_dims(t) == 2) {
                dflash2_drafter_rows_adopt(t, adopt);
                ++n;
            }
        }
        return n;
    } catch (...) {
        return -1;
    }
}

int32_t dflash2_model_selector_top_k(const llama_model * model) {
    return llama_model_dflash_selector_top_k(model);
}

const int32_t * dflash2_model_target_layer_ids(const llama_model * model) {
    return llama_model_target_layer_ids(model);
}

uint32_t dflash2_model_target_layer_ids_n(const llama_model * model) {
    return llama_model_target_layer_ids_n(model);
}

int32_t dflash2_set_cpu_reference(llama_context * ctx, bool value) {
    try {
        typedef void (*set_use_ref_t)(ggml_backend_t, bool);
        ggml_backend_sched_t sched = ctx->get_sched();
        int32_t n_set = 0;
        for (int i = 0; i < ggml_backend_sched_get_n_backends(sched); ++i) {
            ggml_backend_t backend = ggml_backend_sched_get_backend(sched, i);
            ggml_backend_dev_t dev = ggml_backend_get_device(backend);
            if (!dev || ggml_backend_dev_type(dev) != GGML_BACKEND_DEVICE_TYPE_CPU) {
                continue;
            }
            // Looked up through the registry: the CPU backend may be a loaded module.
            auto set = (set_use_ref_t) ggml_backend_reg_get_proc_address(ggml_backend_dev_backend_reg(dev),
                                                                          "ggml_backend_cpu_set_use_ref");
            if (set) {
                set(backend, value);
                ++n_set;
            }
        }
        return n_set;
    } catch (...) {
        return 0;
    }
}

} // extern "C"

struct dflash2_capture {
    std::vector<std::string>        names; // "l_out-<il-1>" for each requested layer il
    std::vector<std::vector<float>> rows;  // captured rows per requested layer
    int64_t                         n_embd;
    std::string                     error;
};

extern "C" {

dflash2_capture * dflash2_capture_new(const int32_t * layers, uint32_t n_layers, int64_t n_embd) {
    try {
        auto * cap = new dflash2_capture();
        cap->n_embd = n_embd;
        for (uint32_t i = 0; i < n_layers; ++i) {
            cap->names.push_back("l_out-" + std::to_string(layers[i] - 1));
        }
        cap->rows.resize(n_layers);
        return cap;
    } catch (...) {
        return nullptr;
    }
}

void dflash2_capture_free(dflash2_capture * cap) {
    delete cap;
}

void dflash2_capture_clear(dflash2_capture * cap) {
    for (auto & r : cap->rows) {
        r.clear();
    }
    cap->error.clear();
}

bool dflash2_capture_eval(ggml_tensor * t, bool ask, void * user_data) {
    auto * cap = static_cast<dflash2_capture *>(user_data);
    try {
        for (size_t i = 0; i < cap->names.size(); ++i) {
            if (cap->names[i] != t->name) {
                continue;
            }
            if (ask) {
                return true; // yes, we want this tensor's data once computed
            }
            if (t->type != GGML_TYPE_F32 || t->ne[0] != cap->n_embd || !ggml_is_contiguous(t)) {
                cap->error = std::string("unexpected layout of ") + t->name;
                return true;
            }
            const size_t n = (size_t) ggml_nelements(t);
            auto & dst = cap->rows[i];
            const size_t off = dst.size();
            dst.resize(off + n);
            ggml_backend_tensor_get(t, dst.data() + off, 0, n * sizeof(float));
            return true;
        }
        // Not ours: no need to stop the graph here. When asked about data, keep going.
        return !ask;
    } catch (...) {
        cap->error = "exception while capturing layer inputs";
        return !ask;
    }
}

const float * dflash2_capture_rows(const dflash2_capture * cap, uint32_t i, int64_t * n_rows) {
    if (i >= cap->rows.size()) {
        *n_rows = 0;
        return nullptr;
    }
    *n_rows = (int64_t) (cap->rows[i].size() / (size_t) cap->n_embd);
    return cap->rows[i].data();
}

const char * dflash2_capture_error(const dflash2_capture * cap) {
    return cap->error.empty() ? nullptr : cap->error.c_str();
}

} // extern "C"

struct dflash2_upstream {
    common_speculative * spec = nullptr;
    llama_tokens         context; // what the n-gram types read; DFlash ignores it
    llama_tokens         result;
};

extern "C" {

dflash2_upstream * dflash2_upstream_new(const char * type, llama_context * ctx_tgt, llama_context * ctx_dft, int32_t n_max, uint32_t n_seq) {
    try {
        const auto kind = common_speculative_type_from_name(type);
        const bool dflash = kind == COMMON_SPECULATIVE_TYPE_DRAFT_DFLASH;
        const bool ngram  = kind >= COMMON_SPECULATIVE_TYPE_NGRAM_SIMPLE && kind <= COMMON_SPECULATIVE_TYPE_NGRAM_CACHE;
        if (!(dflash && ctx_dft != nullptr) && !(ngram && ctx_dft == nullptr)) {
            return nullptr;
        }
        common_params_speculative params;
        params.types                  = { kind };
        params.draft.ctx_tgt          = ctx_tgt;
        params.draft.ctx_dft          = ctx_dft;
        params.draft.n_max            = n_max;
        params.draft.n_min            = 0;
        params.draft.p_min            = 0.0f;
        params.draft.backend_sampling = false; // the drafter's logits stay readable for us
        // common's logger prints straight to the terminal; dflash2 logs through tracing.
        common_log_pause(common_log_main());
        auto * u = new dflash2_upstream();
        u->spec  = common_speculative_init(params, n_seq);
        if (u->spec == nullptr) {
            delete u;
            return nullptr;
        }
        return u;
    } catch (...) {
        return nullptr;
    }
}

void dflash2_upstream_free(dflash2_upstream * u) {
    if (u != nullptr) {
        common_speculative_free(u->spec);
        delete u;
    }
}

int32_t dflash2_upstream_begin(dflash2_upstream * u, int32_t seq, const llama_token * tokens, int32_t n) {
    try {
        u->context.assign(tokens, tokens + n);
        common_speculative_begin(u->spec, seq, u->context);
        return 0;
    } catch (...) {
        return -1;
    }
}

int32_t dflash2_upstream_draft(dflash2_upstream * u, int32_t seq, const llama_token * context, int32_t n_context,
                               llama_token last, int32_t pos0, int32_t n_max, llama_token * out, int32_t cap) {
    try {
        auto & dp = common_speculative_get_draft_params(u->spec, seq);
        u->context.assign(context, context + n_context);
        u->result.clear();
        dp.drafting = true;
        dp.n_max    = n_max;
        dp.pos0     = pos0;
        dp.id_last  = last;
        dp.prompt   = &u->context;
        dp.result   = &u->result;
        common_speculative_draft(u->spec);
        const int32_t n = std::min<int32_t>((int32_t) u->result.size(), std::min(cap, n_max));
        std::copy(u->result.begin(), u->result.begin() + n, out);
        return n;
    } catch (...) {
        return -1;
    }
}

int32_t dflash2_upstream_accept(dflash2_upstream * u, int32_t seq, int32_t n_accepted) {
    try {
        common_speculative_accept(u->spec, seq, (uint16_t) std::clamp(n_accepted, 0, 65535));
        return 0;
    } catch (...) {
        return -1;
    }
}

} // extern "C"
