/*
 * dflash2.h: the C ABI of dflash2, DFlash 2 speculative decoding over llama.cpp.
 *
 * Lossless: at temperature 0 the output is the target's own greedy output token for token;
 * at temperature > 0 it follows the target's sampling distribution.
 *
 * Link with the shared library (-ldflash2, libdflash2.so / .dylib) or the static one
 * (libdflash2.a plus its system libraries: `pkg-config --static --libs dflash2`).
 *
 * HANDLES
 *   dflash2_engine   the loaded target model, the optional DFlash drafter and the settings
 *                    (context size, threads, GPU layers, block size, selection, sampling).
 *                    Immutable once created.
 *   dflash2_session  one conversation with its own llama.cpp contexts and KV cache; sessions
 *                    of one engine share its model weights. A prompt that extends what the
 *                    session has cached (prompt and output of earlier generations) only decodes
 *                    the new part, so a chat that re-renders the whole conversation each turn
 *                    only prefills the new turn.
 *
 * ERRORS
 *   Every call that can fail returns a dflash2_status: DFLASH2_OK (0) or an error code.
 *   Each call leaves a message in this thread's last error (dflash2_last_error): why it
 *   failed, or "" when it succeeded. Arguments are validated: NULL pointers, zero lengths, invalid UTF-8,
 *   out-of-range values and token ids are reported as errors, never crashes. No Rust panic
 *   crosses this boundary: an internal bug is reported as DFLASH2_ERR_PANIC.
 *
 * OWNERSHIP
 *   - A handle made by dflash2_*_new belongs to the caller, who releases it once with the
 *     matching dflash2_*_free (NULL is accepted and ignored).
 *   - A session holds its own reference to the engine's models: the engine may be freed
 *     before its sessions.
 *   - Strings and arrays passed in are borrowed for the duration of the call only.
 *   - Output buffers belong to the caller. A call that writes into one takes its capacity and
 *     reports the size written (or needed) through an out-parameter; when the buffer is too
 *     small it returns DFLASH2_ERR_BUFFER_TOO_SMALL with the needed size, so passing
 *     NULL with capacity 0 queries the size. NULL with a capacity > 0 is an error.
 *   - Strings returned as `const char *` (dflash2_version, dflash2_last_error) belong to the
 *     library: never free them.
 *
 * THREADING
 *   - The engine is immutable: engine calls (tokenize, detokenize, apply_chat_template,
 *     session_new) may run concurrently from any threads.
 *   - A session serves one call at a time. It may move between threads; a call made while
 *     another call on the same session is running (from another thread, or from inside that
 *     session's own callback) fails with DFLASH2_ERR_BUSY instead of racing.
 *   - Freeing a handle while another thread uses it is undefined behaviour.
 *   - dflash2_last_error is per thread.
 *   - Speed on CPU: llama.cpp computes on OpenMP, and every thread that decoded, or loaded
 *     the models (weights are repacked in parallel), keeps a team of n_threads - 1 workers.
 *     Once those outnumber the cores, libgomp stops spinning at its barriers and decoding
 *     slows several-fold (5x measured with 2 teams on 2 cores). Load the engine and run
 *     its sessions on one thread, or keep the teams' threads within the cores.
 *
 * TEXT
 *   All strings are UTF-8. Input strings are NUL-terminated unless a length is passed.
 *   Output text is NUL-terminated; reported lengths exclude the NUL.
 */
#ifndef DFLASH2_H
#define DFLASH2_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The header's ABI version: 2 added dflash2_verify_match (nothing of version 1 changed). */
#define DFLASH2_ABI_VERSION 2

/* ---- types ------------------------------------------------------------------------------ */

typedef int32_t dflash2_token;

typedef enum dflash2_status {
    DFLASH2_OK = 0,
    DFLASH2_ERR_NULL_ARG = 1,         /* a required pointer is NULL */
    DFLASH2_ERR_INVALID_ARG = 2,      /* zero length, value out of range, token outside the vocabulary */
    DFLASH2_ERR_UTF8 = 3,             /* a string is not valid UTF-8 */
    DFLASH2_ERR_BUFFER_TOO_SMALL = 4, /* the needed size was written to the size out-parameter */
    DFLASH2_ERR_MODEL = 5,            /* a model file is missing, unreadable, or rejected by llama.cpp */
    DFLASH2_ERR_MISMATCH = 6,         /* the drafter cannot draft for the target (the message names the field) */
    DFLASH2_ERR_STATE = 7,            /* called out of order, e.g. step or generate before feed */
    DFLASH2_ERR_BUSY = 8,             /* the session is in use by another call */
    DFLASH2_ERR_CONTEXT = 9,          /* the prompt does not fit the context */
    DFLASH2_ERR_TEMPLATE = 10,        /* no chat template, or one llama.cpp does not support */
    DFLASH2_ERR_LLAMA = 11,           /* llama.cpp failed (context creation, decode) */
    DFLASH2_ERR_PANIC = 12            /* internal error, a bug: the session involved should be freed */
} dflash2_status;

/* How a draft is chosen from the drafter's candidates. */
typedef enum dflash2_select {
    DFLASH2_SELECT_NONE = 0,      /* no drafting: plain autoregressive decoding (the baseline) */
    DFLASH2_SELECT_GREEDY = 1,    /* llama.cpp's walk: the best-scoring successor of each pick */
    DFLASH2_SELECT_BEST_PATH = 2, /* the path with the most expected accepted tokens */
    DFLASH2_SELECT_TREE = 3       /* a best-first token tree, verified in one decode */
} dflash2_select;

/* Why a generation ended. */
typedef enum dflash2_finish {
    DFLASH2_FINISH_NONE = 0,     /* still running */
    DFLASH2_FINISH_EOG = 1,      /* an end-of-generation token (not part of the output) */
    DFLASH2_FINISH_LENGTH = 2,   /* n_predict tokens */
    DFLASH2_FINISH_STOP = 3,     /* a stop string (reserved: not offered by this ABI yet) */
    DFLASH2_FINISH_CONTEXT = 4,  /* the context is full */
    DFLASH2_FINISH_CANCELLED = 5 /* the callback asked to stop */
} dflash2_finish;

/* Sampling as llama.cpp users know it (order: penalties, top-k, top-p, min-p, temperature). */
typedef struct dflash2_sampling {
    float temperature;    /* <= 0: greedy (the default) */
    int32_t top_k;        /* <= 0 disables; default 40 */
    float top_p;          /* >= 1 disables; default 0.95 */
    float min_p;          /* <= 0 disables; default 0.05 */
    float repeat_penalty; /* 1 disables (the default); must be > 0 */
    int32_t repeat_last_n;/* <= 0 disables; default 64 */
    uint64_t seed;
} dflash2_sampling;

/* Engine settings: fill with dflash2_engine_params_init, then set the paths. KV caches are
 * f16 for the target and q8_0 for the drafter (the CLI's -ctk/-ctv/-ctkd/-ctvd defaults). */
typedef struct dflash2_engine_params {
    const char *target_path;  /* target GGUF (required) */
    const char *drafter_path; /* DFlash / DFlash 2 drafter GGUF; NULL: look-up drafting alone when
                                 lookup_ngram > 0 (the default), else plain decoding */
    uint32_t n_ctx;           /* context size in tokens (>= 2); default 4096 */
    int32_t n_threads;        /* CPU threads (>= 1); default: available cores, at most 16 */
    int32_t n_gpu_layers;     /* layers offloaded to a GPU (>= 0; GPU builds only); default 999 (all) */
    uint32_t block_size;      /* the anchor plus at most block_size-1 drafted tokens per cycle:
                                 0 (default) = the drafter's trained block, else 2..64 */
    int32_t select;           /* a dflash2_select value; default DFLASH2_SELECT_GREEDY */
    uint32_t tree_budget;     /* node budget of a token tree (>= 1); default 32 */
    dflash2_sampling sampling;
    uint32_t lookup_ngram;    /* context look-up drafting (what followed earlier occurrences of the
                                 context's last tokens; with or without a drafter): 0 = off, else
                                 1..8 = the longest suffix it matches; default 4 (on, as the CLI) */
} dflash2_engine_params;

/* One chat turn: NUL-terminated UTF-8 role ("system", "user", "assistant") and content. */
typedef struct dflash2_chat_message {
    const char *role;
    const char *content;
} dflash2_chat_message;

/* Counters and timings of a session's current (or last) generation. */
typedef struct dflash2_stats {
    uint64_t n_prompt;          /* prompt tokens */
    uint64_t n_prompt_decoded;  /* of which decoded; the rest came from the session's cache */
    uint64_t n_generated;       /* output tokens */
    uint64_t cycles;            /* target verify decodes (plain steps included) */
    uint64_t n_drafted;         /* drafted tokens proposed */
    uint64_t n_accepted;        /* drafted tokens accepted */
    double tau;                 /* mean tokens committed per target verify */
    double tokens_per_second;   /* after the prompt */
    double prefill_ms;
    double draft_ms;
    double verify_ms;
    double host_ms;
    double total_ms;
    int32_t finish;             /* a dflash2_finish value */
} dflash2_stats;

typedef struct dflash2_engine dflash2_engine;
typedef struct dflash2_session dflash2_session;

/*
 * Receives generated text: `text` is `len` bytes of whole UTF-8 characters, NUL-terminated,
 * valid only during the call. Return 0 to continue, non-zero to stop the generation.
 * The callback must not unwind through the library (no C++ exceptions, no longjmp).
 */
typedef int (*dflash2_text_callback)(const char *text, size_t len, void *user_data);

/* ---- library ----------------------------------------------------------------------------- */

/* The library version, e.g. "0.1.0". Static storage. */
const char *dflash2_version(void);

/* This thread's message for the last failed call; "" after a call that succeeded.
 * Valid until the next dflash2 call on this thread. Never NULL. */
const char *dflash2_last_error(void);

/* ---- engine ------------------------------------------------------------------------------ */

/* Fill *params with the defaults (no model paths). */
dflash2_status dflash2_engine_params_init(dflash2_engine_params *params);

/* Check the model files (readable GGUF; a drafter that pairs with the target), load them and
 * store the settings. On success *out is a new engine; on failure *out is NULL. The first call
 * also plugs dflash2's op kernels (attention over f16 caches, Q4_1, Q5_0 and Q8_0 weights, repacked Q4_0
 * weights by several rows, a DFlash drafter's small ops and convolutions, flash attention over q8_0
 * caches; outputs bit-identical to ggml's own) into ggml's CPU backend for the whole process, and
 * the drafter's Q8_0 products in
 * integers (its weights only: not ggml's rounding, which never reaches the generated text): make
 * it while no other llama.cpp computation runs in the process. */
dflash2_status dflash2_engine_new(const dflash2_engine_params *params, dflash2_engine **out);

void dflash2_engine_free(dflash2_engine *engine);

/* Tokenize `text_len` (> 0) bytes of UTF-8 with the target's vocabulary. `add_special` adds
 * BOS/EOS as the model asks; `parse_special` turns special-token text (e.g. "<|im_start|>")
 * into special tokens (wanted for chat-template output). Writes *n_tokens. */
dflash2_status dflash2_tokenize(const dflash2_engine *engine, const char *text, size_t text_len,
                                bool add_special, bool parse_special,
                                dflash2_token *tokens, size_t capacity, size_t *n_tokens);

/* The text of `n_tokens` (> 0) tokens; `special` renders special tokens. A sequence that
 * ends inside a UTF-8 character gets U+FFFD for it. Writes *len (NUL excluded). */
dflash2_status dflash2_detokenize(const dflash2_engine *engine, const dflash2_token *tokens,
                                  size_t n_tokens, bool special,
                                  char *buf, size_t capacity, size_t *len);

/* Render `n_messages` (> 0) messages with the target's own chat template (its Jinja text from
 * the GGUF, rendered as llama-server and Hugging Face render it), ending with the assistant's
 * turn opened when `add_assistant`. Tokenize the result with parse_special. A template that
 * refuses the messages (its raise_exception) fails with DFLASH2_ERR_TEMPLATE and its message. */
dflash2_status dflash2_apply_chat_template(const dflash2_engine *engine,
                                           const dflash2_chat_message *messages, size_t n_messages,
                                           bool add_assistant,
                                           char *buf, size_t capacity, size_t *len);

/* ---- session ----------------------------------------------------------------------------- */

/* A new conversation with its own contexts (n_ctx tokens). On failure *out is NULL. */
dflash2_status dflash2_session_new(const dflash2_engine *engine, dflash2_session **out);

void dflash2_session_free(dflash2_session *session);

/* Start a generation of at most `n_predict` (> 0) tokens after the prompt: decodes what the
 * cache lacks of the prompt and commits the first output token. Abandons a generation in
 * progress. Then call dflash2_session_generate or dflash2_session_step. */
dflash2_status dflash2_session_feed(dflash2_session *session, const dflash2_token *tokens,
                                    size_t n_tokens, uint32_t n_predict);

/* Run the fed generation to its end, passing each cycle's text to `callback`. Returns
 * DFLASH2_OK also when the callback stopped it (finish = DFLASH2_FINISH_CANCELLED in the
 * stats). Tokens already returned by dflash2_session_step are not passed again. */
dflash2_status dflash2_session_generate(dflash2_session *session, dflash2_text_callback callback,
                                        void *user_data);

/* One speculative cycle (draft, verify, commit): writes the newly accepted tokens (the
 * target's own next token included; at most block_size per cycle) and *n_tokens. Tokens that
 * do not fit `capacity` (> 0) are returned by the next call without a new cycle. *finish is
 * DFLASH2_FINISH_NONE until the generation has ended and every token was returned; after
 * that, calls return 0 tokens and the same finish. */
dflash2_status dflash2_session_step(dflash2_session *session, dflash2_token *tokens,
                                    size_t capacity, size_t *n_tokens, int32_t *finish);

/* Statistics of the current or last generation (DFLASH2_ERR_STATE before any). */
dflash2_status dflash2_session_stats(const dflash2_session *session, dflash2_stats *out);

/* Forget the conversation: the next prompt is decoded from scratch. */
dflash2_status dflash2_session_reset(dflash2_session *session);


/* ==== Adding DFlash 2 to an existing llama.cpp frontend: dflash2_spec_* ====================
 *
 * For a frontend that already runs llama.cpp (its own llama_model, llama_context, sampler
 * chain, KV cache and slots): a speculator attached to its target context drafts blocks for
 * it, and two helpers verify them with the frontend's own sampler chain. The shape is
 * llama.cpp's common/speculative.h: begin / process after each target decode / draft /
 * accept. See ffi/examples/frontend.c for the whole loop.
 *
 * LINKING: the pointers the frontend passes must come from the libllama dflash2 runs on. Link
 * the frontend against libdflash2.a (it carries its llama.cpp; compile with that build's
 * llama.h, found under target/release/build/llama-cpp-sys-2-*\/out/include), or build both
 * against one shared libllama. dflash2_spec_abi_check says which it is, before any pointer
 * crosses.
 *
 * FEATURES: the drafter reads the target's hidden states (the inputs of a few target layers)
 * at every position before each draft. Three ways to provide them:
 *   (a) capture: dflash2_spec_capture_new fills the frontend's llama_context_params with a
 *       cb_eval callback BEFORE it creates the context; then pass the capture in
 *       dflash2_spec_params.capture and call dflash2_spec_process after each target decode.
 *       Any architecture. A frontend with its own cb_eval calls dflash2_spec_capture_eval from
 *       it with the user data the capture installed.
 *   (b) native: without a capture, dflash2_spec_init turns on llama.cpp's layer-input
 *       extraction in the frontend's context, where the architecture has it (llama, qwen3,
 *       qwen3moe, qwen3next, qwen35, qwen35moe, lfm2); call dflash2_spec_process after each
 *       target decode. A decode must fit one micro-batch (n_ubatch), or earlier rows are lost.
 *   (c) feed: the frontend computes the features itself and passes them with
 *       dflash2_spec_feed (dflash2_spec_get_info gives the layers and the row width).
 * A batch row of one begun sequence gives that sequence its features at the row's position;
 * a draft at anchor position p uses the positions below p and forgets the rest (the rows of
 * drafts the target rejected), so a chain needs no further bookkeeping. Rows of several
 * sequences (a token tree) are taken with dflash2_spec_accept_rows.
 *
 * The caller keeps ctx_tgt (and the capture) alive until dflash2_spec_free; free the capture
 * after the context. One thread at a time per speculator (else DFLASH2_ERR_BUSY). */

struct llama_model;
struct llama_context;
struct llama_context_params;
struct llama_batch;
struct llama_sampler;
struct ggml_tensor;

typedef struct dflash2_spec dflash2_spec;
typedef struct dflash2_spec_capture dflash2_spec_capture;

/* What the frontend's compiler and linker saw of llama.h: fill with DFLASH2_SPEC_ABI_INIT
 * where llama.h is included. */
typedef struct dflash2_spec_abi {
    size_t sizeof_context_params;
    size_t sizeof_model_params;
    size_t sizeof_batch;
    size_t sizeof_token_data_array;
    void (*backend_init)(void); /* the frontend's llama_backend_init */
} dflash2_spec_abi;

#define DFLASH2_SPEC_ABI_INIT                                                                  \
    { sizeof(struct llama_context_params), sizeof(struct llama_model_params), sizeof(struct llama_batch), \
      sizeof(llama_token_data_array), llama_backend_init }

typedef struct dflash2_spec_params {
    uint32_t block_size;   /* tokens per cycle with the anchor: 0 (default) = adaptive, drafts as long
                              as the reported verify times say pays (nothing while drafting does not
                              pay; without reports, the drafter's whole block; the drafter drafts
                              twice as deep as recent drafts were cut to); else 2..trained block */
    int32_t select;        /* DFLASH2_SELECT_GREEDY (default), _BEST_PATH or _TREE (dflash2_spec_draft_tree) */
    uint32_t tree_budget;  /* nodes of a token tree; default 32 */
    float temperature;     /* 0 (default): draft the most likely path (what dflash2_verify_match and
                              _greedy accept most). > 0: draw drafts from the drafter's law at this
                              temperature (set it to the sampler chain's; verify with
                              dflash2_verify_sample, which is lossless either way) */
    uint64_t seed;         /* draws of sampled drafts and of rejection sampling */
    int32_t n_threads;     /* drafter threads; 0 (default) = the available cores, at most 16 */
    dflash2_spec_capture *capture; /* (a) above, or NULL */
} dflash2_spec_params;

/* How dflash2_spec_process reads features. */
enum {
    DFLASH2_FEATURES_FEED = 0,    /* (c) only: dflash2_spec_process refuses */
    DFLASH2_FEATURES_NATIVE = 1,  /* (b) */
    DFLASH2_FEATURES_CALLBACK = 2 /* (a) */
};

typedef struct dflash2_spec_info {
    uint32_t n_seq;
    uint32_t trained_block;       /* the drafter's block, anchor included */
    uint64_t feature_width;       /* floats per position for dflash2_spec_feed */
    int32_t feature_source;       /* a DFLASH2_FEATURES_* value */
    uint32_t n_feature_layers;
    int32_t feature_layers[16];   /* target layers whose INPUTS are read, in row order */
} dflash2_spec_info;

typedef struct dflash2_spec_stats {
    uint64_t cycles;     /* verifies (plain steps included, the prompt's first token not) */
    uint64_t drafts;     /* drafter calls */
    uint64_t n_drafted;
    uint64_t n_accepted;
    double tau;          /* tokens committed per verify */
    double draft_ms;
} dflash2_spec_stats;

dflash2_spec_params dflash2_spec_default_params(void);

/* DFLASH2_OK when the frontend's llama.h structs and its libllama are the ones dflash2 runs on;
 * DFLASH2_ERR_MISMATCH (naming the struct, or the second libllama) otherwise. */
dflash2_status dflash2_spec_abi_check(const dflash2_spec_abi *abi);

/* (a): before llama_init_from_model, point cparams->cb_eval at a capture of the layers the
 * drafter reads. *out is freed with dflash2_spec_capture_free, after the context. */
dflash2_status dflash2_spec_capture_new(struct llama_model *target, const char *drafter_gguf,
                                        struct llama_context_params *cparams, dflash2_spec_capture **out);
void dflash2_spec_capture_free(dflash2_spec_capture *capture);
bool dflash2_spec_capture_eval(struct ggml_tensor *t, bool ask, void *user_data);

/* Load the drafter, check that it pairs with `target` (DFLASH2_ERR_MISMATCH names the field;
 * ERR_MODEL: unreadable file), and create its context next to ctx_tgt (a context of `target`,
 * else ERR_INVALID_ARG) for sequences 0..n_seq-1. */
dflash2_status dflash2_spec_init(struct llama_model *target, struct llama_context *ctx_tgt, const char *drafter_gguf,
                                 const dflash2_spec_params *params, uint32_t n_seq, dflash2_spec **out);
void dflash2_spec_free(dflash2_spec *spec);
dflash2_status dflash2_spec_get_info(const dflash2_spec *spec, dflash2_spec_info *out);

/* Start (or restart) a sequence before its prompt is decoded: its drafter cache and counters
 * are emptied. Drafting in a sequence that has not begun is DFLASH2_ERR_STATE. */
dflash2_status dflash2_spec_begin(dflash2_spec *spec, int32_t seq);
/* The frontend removed positions >= p0 of seq from its cache; p0 < 0 frees the sequence
 * (it must begin again). */
dflash2_status dflash2_spec_seq_rm(dflash2_spec *spec, int32_t seq, int32_t p0);

/* After each llama_decode on the target context (prompt, plain steps and verifies). A batch
 * without positions (llama_batch_get_one) is sequence 0 continuing its cache. */
dflash2_status dflash2_spec_process(dflash2_spec *spec, const struct llama_batch *batch);
/* (c): features of positions pos0..pos0+n-1 of seq, n rows of feature_width floats. */
dflash2_status dflash2_spec_feed(dflash2_spec *spec, int32_t seq, int32_t pos0, int32_t n, const float *rows);

/* Draft after `last`, the committed token at position `pos` of seq that the next verify decodes
 * first. Writes up to `capacity` tokens to `tokens` and their count to *n_out (0: decode
 * plainly this time, the adaptive block expects a plain step to pay better). */
dflash2_status dflash2_spec_draft(dflash2_spec *spec, int32_t seq, dflash2_token last, int32_t pos,
                                  dflash2_token *tokens, size_t capacity, size_t *n_out);
/* A token tree (DFLASH2_SELECT_TREE): node k is tokens[k], its parent parents[k] (-1: the anchor);
 * parents come first. Verify it with one sequence per leaf, each node at position pos + depth. */
dflash2_status dflash2_spec_draft_tree(dflash2_spec *spec, int32_t seq, dflash2_token last, int32_t pos,
                                       dflash2_token *tokens, int32_t *parents, size_t capacity, size_t *n_out);

/* For frontends that verify with their own code: the target kept n_accepted drafted tokens of
 * seq's last draft (0 for a plain step). More than were drafted is DFLASH2_ERR_INVALID_ARG.
 * Not after dflash2_verify_*, which record the cycle themselves. */
dflash2_status dflash2_spec_accept(dflash2_spec *spec, int32_t seq, int32_t n_accepted);
/* A tree's accepted path: rows of the last processed batch whose features seq keeps. */
dflash2_status dflash2_spec_accept_rows(dflash2_spec *spec, int32_t seq, const int32_t *rows, int32_t n);
/* A target decode of n_tokens rows took ms: the adaptive block weighs drafts by these times. */
dflash2_status dflash2_spec_report_verify(dflash2_spec *spec, int32_t n_tokens, double ms);
dflash2_status dflash2_spec_get_stats(const dflash2_spec *spec, int32_t seq, dflash2_spec_stats *out);

/* Verify seq's last draft (or a plain step when none is pending) with the frontend's sampler
 * chain, over the output rows of its verify batch on ctx (the speculator's target context):
 * rows[0] the anchor's row, rows[1 + k] draft node k's (n_rows = drafted + 1; every row must
 * have asked for logits). Writes the accepted drafted tokens followed by the target's own next
 * token (at most n_rows tokens) and their count; the chain accepts each of them. The frontend
 * then keeps the anchor and the accepted drafts in its cache and removes the rest.
 *   dflash2_verify_greedy: a chain ending in `greedy` (its filters, then the argmax): output
 *     identical to the frontend's own loop without speculation.
 *   dflash2_verify_sample: a chain ending in `dist`: rejection sampling against the drafter's
 *     law (one-hot where the draft was the most likely path), so the tokens follow the
 *     chain's law exactly; uses the speculator's seeded RNG, not the chain's: the same
 *     distribution as the frontend's own loop, not the same text.
 *   dflash2_verify_match (ABI version 2): any chain; it samples each row itself
 *     (llama_sampler_sample: its filters, its draw, its random stream, one draw per returned
 *     token) and drafts are kept while they equal its token: the frontend's own loop's text,
 *     token for token, for its seed (where the target's verify batches are bit-exact).
 * The wrong helper for the chain is DFLASH2_ERR_INVALID_ARG, as are chains with samplers that
 * are no fixed law of the logits (mirostat, xtc). */
dflash2_status dflash2_verify_greedy(dflash2_spec *spec, int32_t seq, struct llama_sampler *chain,
                                     struct llama_context *ctx, const int32_t *rows, int32_t n_rows,
                                     dflash2_token *out, size_t capacity, size_t *n_out);
dflash2_status dflash2_verify_sample(dflash2_spec *spec, int32_t seq, struct llama_sampler *chain,
                                     struct llama_context *ctx, const int32_t *rows, int32_t n_rows,
                                     dflash2_token *out, size_t capacity, size_t *n_out);
dflash2_status dflash2_verify_match(dflash2_spec *spec, int32_t seq, struct llama_sampler *chain,
                                    struct llama_context *ctx, const int32_t *rows, int32_t n_rows,
                                    dflash2_token *out, size_t capacity, size_t *n_out);

#ifdef __cplusplus
}
#endif

#endif /* DFLASH2_H */
