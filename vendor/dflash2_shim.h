/* C view of the parts of llama.cpp that dflash2 needs beyond llama.h:
 * the staging DFlash calls of src/llama-ext.h (C++ linkage upstream) and a
 * graph-evaluation callback that captures layer inputs for any architecture. */
#pragma once

#include <stdbool.h>
#include <stdint.h>

#include "llama.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- staging API, re-exported with C linkage ---- */
void          dflash2_set_embeddings_layer_inp(struct llama_context * ctx, uint32_t layer, bool value);
const float * dflash2_get_embeddings_layer_inp(struct llama_context * ctx, uint32_t layer);
void          dflash2_set_embeddings_nextn(struct llama_context * ctx, bool value, bool masked);
const float * dflash2_get_embeddings_nextn(struct llama_context * ctx);
int32_t         dflash2_model_selector_top_k(const struct llama_model * model);
const int32_t * dflash2_model_target_layer_ids(const struct llama_model * model);
uint32_t        dflash2_model_target_layer_ids_n(const struct llama_model * model);

/* ---- the CPU backend's reference kernels ----
 * Makes every CPU backend of ctx run ggml's reference paths (llama.cpp's `--use-ref`): no
 * split-KV or tiled flash attention, no tiled or llamafile matrix products, no op fusion, so
 * each output row is computed alone whatever the batch. Returns how many CPU backends it set
 * (0: none, or this ggml has no such switch). */
int32_t         dflash2_set_cpu_reference(struct llama_context * ctx, bool value);

/* ---- few-row products on AMX CPUs (vendor/amx_few_rows.cpp) ----
 * Makes llama.cpp multiply model's q4_0 / q4_1 / q8_0 weights in its AMX buffer by 2-6 rows with
 * kernels that round each row as a single-row product does, instead of AMX tiles made for 32 rows.
 * Returns how many weights it took (0: none repacked for AMX), or -1 where this build has no AMX. */
int32_t         dflash2_model_few_row_kernels(struct llama_model * model);

/* ---- attention over an f16 cache (vendor/f16_attention.cpp) ----
 * Makes ggml's CPU backend compute f16 x f32 matrix products (attention over an f16 KV cache
 * without flash attention) with a kernel that rounds every output as ggml_vec_dot_f16 does,
 * converting each cache row once for the queries that read it.
 * Process-wide, so switch it only while nothing in the process computes; `on` false gives ggml's
 * own kernel back (for comparisons). Returns 1 when the kernel is on, 0 when off (or it failed to
 * register), -1 where this build has no AVX-512. */
int32_t         dflash2_set_f16_attention(bool on);

/* ---- Q5_0, Q8_0 and Q4_1 weights (vendor/quant_rows.cpp) ----
 * Make ggml's CPU backend multiply 2-D Q5_0 (Q8_0) weights by f32 activations with a kernel that
 * rounds every output as ggml_vec_dot_q5_0_q8_0 (ggml_vec_dot_q8_0_q8_0) does, reading each weight
 * block once for up to four activation rows and running several weight rows side by side. One
 * kernel per weight type; Q8_0 weights that ggml's AMX backend holds stay with it. Process-wide, as
 * above. Return 1 when on, 0 when off (or it failed to register), -1 where this build has no
 * AVX512-VNNI. */
int32_t         dflash2_set_q5_0_rows(bool on);
int32_t         dflash2_set_q8_0_rows(bool on);
/* The same for Q4_1 and Q5_1 weights (rounding as ggml_vec_dot_q4_1_q8_1 / _q5_1_q8_1, minimums
 * included). */
int32_t         dflash2_set_q4_1_rows(bool on);
/* The count of outputs that differ from ggml's, over products of random weights of the type by
 * random activation rows (1-17 rows, widths 32-1536): 0 when they agree, -1 where not built, -3 on
 * an error. */
int64_t         dflash2_q5_0_rows_differences(uint32_t seed, int32_t n_threads);
int64_t         dflash2_q8_0_rows_differences(uint32_t seed, int32_t n_threads);
int64_t         dflash2_q4_1_rows_differences(uint32_t seed, int32_t n_threads);

/* ---- Q4_K, Q5_K, Q6_K and IQ4_XS weights that ggml keeps unrepacked (vendor/kquant_rows.cpp) ----
 * Make ggml's CPU backend multiply such 2-D weights by f32 activations (any number of rows) with a
 * kernel that rounds every output as ggml_vec_dot_<type>_q8_K does, each weight superblock unpacked
 * once for up to 8 activation rows. One switch for the four types; process-wide, as above. Returns 1
 * when on, 0 when off (or it failed to register), -1 where this build has no AVX512-VNNI. */
int32_t         dflash2_set_kquant_rows(bool on);
/* The count of outputs that differ from ggml's, over products of random weights of the four types
 * by random activation rows (1-33 rows, widths 256-2304): 0 when they agree, -1 where not built, -3
 * on an error. */
int64_t         dflash2_kquant_rows_differences(uint32_t seed, int32_t n_threads);

/* ---- Q4_0 and IQ4_NL weights repacked for AVX2 (vendor/q4_x8_rows.cpp) ----
 * Puts a kernel in front of ggml's for model's Q4_0 (IQ4_NL) weights that ggml repacked into
 * 8-column runs (block_q4_0x8, block_iq4_nlx8): products of 2 or more f32 rows, every output rounded
 * as ggml's single-row gemv rounds it, each block's weights unpacked once for up to 8 rows. Returns
 * how many weights it took (0: none so repacked), or -1 where this build has no AVX512-VNNI. */
int32_t         dflash2_model_q4_0x8_rows(struct llama_model * model);
int32_t         dflash2_model_iq4_nlx8_rows(struct llama_model * model);
/* Switch that kernel for the whole process (off: ggml's own); as above, only while nothing in the
 * process computes. Return 1 when on, 0 when off, -1 where not built. */
int32_t         dflash2_set_q4_0x8_rows(bool on);
int32_t         dflash2_set_iq4_nlx8_rows(bool on);
/* Model weights the kernel was put in front of in this process (-1 where not built). */
int64_t         dflash2_q4_0x8_rows_fronted(void);
int64_t         dflash2_iq4_nlx8_rows_fronted(void);
/* The count of outputs that differ from ggml's gemv of their row alone, over random weights ggml
 * repacked times random activation rows (2-33 rows, 8-136 columns): 0 when they agree, -1 where not
 * built, -2 where ggml did not repack them so, -3 on an error. */
int64_t         dflash2_q4_0x8_rows_differences(uint32_t seed, int32_t n_threads);
int64_t         dflash2_iq4_nlx8_rows_differences(uint32_t seed, int32_t n_threads);

/* ---- Q4_K (and Q2_K) weights repacked for AVX2 (AVX-512) (vendor/kx8_rows.cpp) ----
 * Puts a kernel in front of ggml's for model's Q4_K (Q2_K) weights that ggml repacked into 8-column
 * runs (block_q4_Kx8, block_q2_Kx8): products of any number of f32 rows, every output rounded as
 * ggml's single-row gemv (ggml_gemv_q4_K_8x8_q8_K, _q2_K_) rounds it (ggml's gemm for 4 rows at a
 * time rounds otherwise), each run's quants unpacked once for up to 8 rows. Returns how many
 * weights it took (0: none so repacked), or -1 where this build has no AVX512-VNNI. */
int32_t         dflash2_model_q4_kx8_rows(struct llama_model * model);
int32_t         dflash2_model_q2_kx8_rows(struct llama_model * model);
/* Switch that kernel for the whole process (off: ggml's own); as above, only while nothing in the
 * process computes. Return 1 when on, 0 when off, -1 where not built. */
int32_t         dflash2_set_q4_kx8_rows(bool on);
int32_t         dflash2_set_q2_kx8_rows(bool on);
/* Model weights the kernel was put in front of in this process (-1 where not built). */
int64_t         dflash2_q4_kx8_rows_fronted(void);
int64_t         dflash2_q2_kx8_rows_fronted(void);
/* The count of outputs that differ from ggml's gemv of their row alone, over random weights ggml
 * repacked times random activation rows (1-33 rows, 8-136 columns): 0 when they agree, -1 where not
 * built, -2 where ggml did not repack them so, -3 on an error. */
int64_t         dflash2_q4_kx8_rows_differences(uint32_t seed, int32_t n_threads);
int64_t         dflash2_q2_kx8_rows_differences(uint32_t seed, int32_t n_threads);

/* ---- the DFlash drafter graph's small ops (vendor/drafter_ops.cpp) ----
 * Makes ggml's CPU backend run the fills of rows under 16 wide, the zero pads, the top-k over
 * vocabulary-wide rows, the set_rows of rows under 16 wide, the f32 repeats and the f32 adds and
 * multiplies of narrow or broadcast rows of a DFlash drafter's graph with kernels that give the
 * same values in a fraction of the time (one run per thread; the same partial sort over the indices
 * that can enter it; no call or division per value). Process-wide, as above. Returns 1 when on, 0
 * when off (or it failed to register). */
int32_t         dflash2_set_drafter_ops(bool on);
/* The same count for the drafter ops, each op they take on random inputs in the drafter graph's
 * shapes and others: 0 when they agree, -2 where the kernels would not take one, -3 on an error. */
int64_t         dflash2_drafter_ops_differences(uint32_t seed, int32_t n_threads);

/* ---- the DFlash 2 drafter's convolutions as one op each (vendor/drafter_conv.cpp) ----
 * Makes ggml's CPU backend compute each DFlash 2 convolution at its last add from its per-tap
 * weights and hidden rows, with the same values; the 13 ops between them (build_dflash2_conv's tap
 * copies, pads, multiplies and adds) are marked when ggml plans the graph, and skipped with their
 * barriers. Process-wide, as above. Returns 1 when on, 0 when off (or it failed to register). */
int32_t         dflash2_set_drafter_conv(bool on);
/* How many convolutions the kernel has computed in this process. */
int64_t         dflash2_drafter_conv_computed(void);
/* How many outputs of convolutions of random inputs (SmolLM2's drafter's shapes and others, both
 * sides), computed by the kernel twice over the same graph and then by ggml with the kernel
 * switched off, differ in any bit from ggml's: 0 when they agree; -2 where the kernel did not mark
 * a convolution's ops while on or did not give them back when off, -3 on an internal error. */
int64_t         dflash2_drafter_conv_differences(uint32_t seed, int32_t n_threads);

/* ---- flash attention over a q8_0 cache (vendor/q8_0_attention.cpp) ----
 * Makes ggml's CPU backend run flash attention with q8_0 K and V (a DFlash drafter's cache) with a
 * kernel that rounds every output as ggml's does, taking the query rows of a KV head through the
 * cells together (each cell's K and V widened once for all of them). Process-wide, as above.
 * Returns 1 when on, 0 when off (or it failed to register), -1 where this build has no
 * AVX512-VNNI. */
int32_t         dflash2_set_q8_0_attention(bool on);
/* How many outputs of flash attention over random q8_0 K and V (head sizes 64 and 128, GQA groups
 * of 1-8, 1-40 tokens, 1-700 cells, a mask of zeros, -inf and small biases; drawn from `seed`)
 * differ in any bit between ggml's kernel and dflash2's, on n_threads threads: 0 when they agree;
 * -1 where this build has no such kernel, -2 where it would not take a shape, -3 on an internal
 * error. Turns the kernel off and on process-wide meanwhile (as dflash2_set_q8_0_attention). */
int64_t         dflash2_q8_0_attention_differences(uint32_t seed, int32_t n_threads);

/* ---- integer products of a drafter's Q8_0 weights (vendor/drafter_rows.cpp) ----
 * Makes ggml's CPU backend take the products of adopted Q8_0 weights (a drafter's) in integers:
 * each weight row requantized once to bytes with one scale per row, each activation row to bytes
 * with one scale. Not ggml's rounding (a drafter's numerics never reach the output: the
 * target verifies every drafted token); targets' weights are never adopted. Process-wide, as
 * above. Returns 1 when on, 0 when off (or it failed to register), -1 where this build has no
 * AVX512-VNNI. */
int32_t         dflash2_set_drafter_rows(bool on);
/* Adopts (or, with adopt false, gives up one adoption of) every 2-D Q8_0 weight of `model` for
 * the kernel above; a weight stays adopted while any adopter holds it. Returns how many weights,
 * -1 on an error. */
int64_t         dflash2_adopt_drafter_weights(const struct llama_model * model, bool adopt);
/* One weight (the kernel's own entry, which dflash2_adopt_drafter_weights calls per weight). */
void            dflash2_drafter_rows_adopt(const struct ggml_tensor * weight, bool adopt);
/* How many integer forms of adopted weights the kernel has made in this process (one per weight and
 * adoption): 0 where no drafter's products went through it (no VNNI, or ggml's AMX backend holds
 * the weights). */
int64_t         dflash2_drafter_rows_made(void);
/* How many outputs of products of random Q8_0 weights (widths 32-2880, 4 or 136 rows, 1-17
 * activation rows, drawn from `seed`) differ in any bit from the kernel's scheme taken one product at
 * a time, or lie further from the exact product than the scheme's error bound (half a step of the
 * weight row's scale and of the activation row's), on n_threads threads: 0 when none; -1 where this build has no such kernel, -2 where it would not
 * take a shape, -3 on an internal error. Turns the kernel on meanwhile. */
int64_t         dflash2_drafter_rows_excess(uint32_t seed, int32_t n_threads);

/* ---- layer-input capture through cb_eval ----
 * The input of layer il is the graph tensor named "l_out-<il-1>". Install
 * dflash2_capture_eval as cb_eval with the capture as user data; after each
 * decode, rows holds every batch row of each requested layer, in batch order. */
typedef struct dflash2_capture dflash2_capture;

dflash2_capture * dflash2_capture_new(const int32_t * layers, uint32_t n_layers, int64_t n_embd);
void              dflash2_capture_free(dflash2_capture * cap);
/* Forget the rows of the previous decode (call before each decode). */
void              dflash2_capture_clear(dflash2_capture * cap);
bool              dflash2_capture_eval(struct ggml_tensor * t, bool ask, void * user_data);
/* Rows captured for the i-th requested layer; *n_rows receives their count. */
const float *     dflash2_capture_rows(const dflash2_capture * cap, uint32_t i, int64_t * n_rows);
/* Non-null when a captured tensor had an unexpected shape or layout. */
const char *      dflash2_capture_error(const dflash2_capture * cap);

/* ---- llama.cpp's own drafting (common/speculative.cpp), as baselines ----
 * Drafting only, by one of llama.cpp's speculative types named as its `--spec-type` names them:
 * "draft-dflash" (the block decode and llama.cpp's greedy lattice walk over ctx_dft; the caller keeps
 * the drafter's cache: feature injection, removal of the block's cells) or an n-gram type
 * ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache"; ctx_dft NULL),
 * with llama.cpp's default settings for it. NULL for an unknown name or a failure. */
typedef struct dflash2_upstream dflash2_upstream;

dflash2_upstream * dflash2_upstream_new(const char * type, struct llama_context * ctx_tgt, struct llama_context * ctx_dft,
                                        int32_t n_max, uint32_t n_seq);
void               dflash2_upstream_free(dflash2_upstream * u);
/* A new generation on `seq` whose context (prompt) is tokens[0..n): the n-gram types index it. */
int32_t            dflash2_upstream_begin(dflash2_upstream * u, int32_t seq, const llama_token * tokens, int32_t n);
/* Draft up to n_max tokens after `last` at position pos0 of sequence `seq` into out (capacity
 * cap); context[0..n_context) is every token before `last`. Returns how many, or -1 on failure. */
int32_t            dflash2_upstream_draft(dflash2_upstream * u, int32_t seq, const llama_token * context, int32_t n_context,
                                          llama_token last, int32_t pos0, int32_t n_max, llama_token * out, int32_t cap);
/* The target took n_accepted of the last draft of `seq` (the n-gram types adapt to it). */
int32_t            dflash2_upstream_accept(dflash2_upstream * u, int32_t seq, int32_t n_accepted);

/* ---- llama.cpp's chat code (common/chat.cpp), in dflash2_chat.cpp ----
 * Strings cross as JSON; a failure returns NULL and sets *error (free it with dflash2_string_free). */
typedef struct dflash2_chat        dflash2_chat;
typedef struct dflash2_chat_parser dflash2_chat_parser;

/* llama.cpp's templates for `model` from the Jinja template text `tmpl`. */
dflash2_chat *        dflash2_chat_new(const struct llama_model * model, const char * tmpl, char ** error);
void                  dflash2_chat_free(dflash2_chat * chat);
/* Render `messages_json` (OpenAI's messages) with the template variables of `kwargs_json` (an object)
 * and set up the parser of the answer for `reasoning_format` (llama.cpp's names). *info receives
 * {"prompt", "generation_prompt", "supports_thinking", "thinking_start_tag", "thinking_end_tags",
 * "preserved_tokens"}. */
dflash2_chat_parser * dflash2_chat_apply(const dflash2_chat * chat, const char * messages_json, const char * kwargs_json,
                                         bool add_generation_prompt, bool enable_thinking,
                                         const char * reasoning_format, char ** info, char ** error);
void                  dflash2_chat_parser_free(dflash2_chat_parser * parser);
/* Split text[0..len) (an answer so far when `partial`) into {"content", "reasoning_content"}. */
char *                dflash2_chat_parse(const dflash2_chat_parser * parser, const char * text, size_t len, bool partial,
                                         char ** error);
void                  dflash2_string_free(char * s);
/* llama.cpp's reasoning budget (common/reasoning-budget.h), a sampler: after start[0..n_start) (or
 * from the first token when `open`), `budget` tokens of thinking, then forced[0..n_forced) token by
 * token (every other token banned) unless end[0..n_end) came first. NULL on failure. */
struct llama_sampler * dflash2_reasoning_budget(const struct llama_vocab * vocab, const llama_token * start, size_t n_start,
                                                const llama_token * end, size_t n_end, const llama_token * forced,
                                                size_t n_forced, int32_t budget, bool open);

#ifdef __cplusplus
}
#endif
