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
    const char *drafter_path; /* DFlash / DFlash 2 drafter GGUF; NULL: plain decoding whatever `select`
                                 says, or look-up drafting alone when lookup_ngram > 0 */
    uint32_t n_ctx;           /* context size in tokens (>= 2); default 4096 */
    int32_t n_threads;        /* CPU threads (>= 1); default: available cores, at most 16 */
    int32_t n_gpu_layers;     /* layers offloaded to a GPU (>= 0; GPU builds only); default 999 (all) */
    uint32_t block_size;      /* the anchor plus at most block_size-1 drafted tokens per cycle:
                                 0 (default) = the drafter's trained block, else 2..64 */
    int32_t select;           /* a dflash2_select value; default DFLASH2_SELECT_GREEDY */
    uint32_t tree_budget;     /* node budget of a token tree (>= 1); default 32 */
    dflash2_sampling sampling;
    uint32_t lookup_ngram;    /* context look-up drafting (what followed earlier occurrences of the
                                 context's last tokens; with or without a drafter): 0 (default) = off,
                                 else 1..8 = the longest suffix it matches (4 is a good start) */
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
 * store the settings. On success *out is a new engine; on failure *out is NULL. */
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

#ifdef __cplusplus
}
#endif

#endif /* DFLASH2_H */
