/*
 * frontend.c: a minimal llama.cpp frontend (its own model, context, sampler chain and KV
 * rollback, written against llama.h) that drafts with a DFlash 2 drafter through dflash2_spec_*.
 *
 *   cc -std=c11 frontend.c -I<dflash2>/ffi -I<llama.cpp build>/include libdflash2.a \
 *      -lstdc++ -lgomp -lm -lpthread -ldl -o frontend
 *   ./frontend -m TARGET.gguf [-d DRAFTER.gguf] -p PROMPT [-n N] [--temp T] [--seed S] [--runs R]
 *              [--block B] [--select greedy|best-path] [--capture] [--match]
 *
 * Without -d it decodes plainly (one llama_decode and one llama_sampler_sample per token): the
 * baseline the speculative loop must reproduce. The prompt is tokenized as given (special
 * tokens parsed). Each run prints its generated token ids on one line of stdout; the
 * speculator's statistics go to stderr. --runs R samples R times with seeds S..S+R-1; the
 * prompt's cells stay cached from the first run on, as a server reuses a cached prompt: a
 * later run drops the last one's tokens and decodes only the prompt's last token again.
 * --capture installs the layer-input capture (any architecture); otherwise llama.cpp's own
 * extraction is used (llama, qwen3, ...). At --temp > 0, --match verifies with
 * dflash2_verify_match (the chain samples each row: the text of the loop without -d, for a
 * seed) over the most likely drafts; otherwise with dflash2_verify_sample (rejection sampling).
 */
#define _POSIX_C_SOURCE 200809L /* setenv, clock_gettime */
#include <llama.h>
#include <dflash2.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MAX_BLOCK 64

static int die(const char *what) {
    fprintf(stderr, "frontend: %s: %s\n", what, dflash2_last_error());
    exit(1);
}

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static struct llama_sampler *make_chain(float temp, uint32_t seed) {
    struct llama_sampler *chain = llama_sampler_chain_init(llama_sampler_chain_default_params());
    if (temp <= 0) {
        llama_sampler_chain_add(chain, llama_sampler_init_greedy());
    } else {
        llama_sampler_chain_add(chain, llama_sampler_init_top_k(40));
        llama_sampler_chain_add(chain, llama_sampler_init_top_p(0.95f, 1));
        llama_sampler_chain_add(chain, llama_sampler_init_temp(temp));
        llama_sampler_chain_add(chain, llama_sampler_init_dist(seed));
    }
    return chain;
}

int main(int argc, char **argv) {
    const char *target_path = NULL, *drafter_path = NULL, *prompt = NULL, *select = "greedy";
    int n_predict = 64, runs = 1, capture = 0, block = 0, match = 0;
    float temp = 0;
    uint32_t seed = 1;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--capture")) { capture = 1; continue; }
        if (!strcmp(a, "--match")) { match = 1; continue; }
        if (!v) { fprintf(stderr, "frontend: %s needs a value\n", a); return 2; }
        i++;
        if (!strcmp(a, "-m")) target_path = v;
        else if (!strcmp(a, "-d")) drafter_path = v;
        else if (!strcmp(a, "-p")) prompt = v;
        else if (!strcmp(a, "-n")) n_predict = atoi(v);
        else if (!strcmp(a, "--temp")) temp = (float)atof(v);
        else if (!strcmp(a, "--seed")) seed = (uint32_t)atol(v);
        else if (!strcmp(a, "--runs")) runs = atoi(v);
        else if (!strcmp(a, "--block")) block = atoi(v);
        else if (!strcmp(a, "--select")) select = v;
        else { fprintf(stderr, "frontend: unknown option %s\n", a); return 2; }
    }
    if (!target_path || !prompt) { fprintf(stderr, "usage: frontend -m T.gguf [-d D.gguf] -p PROMPT ...\n"); return 2; }

    /* Speculation is lossless only where a verify batch gives every row the numbers a single
     * step gives. ggml's tiled K-quant kernel and some repacked layouts round batches
     * differently on some CPUs (`dflash2 inspect T.gguf --check` tells per model), so this
     * frontend turns both off, with or without a drafter. */
    setenv("GGML_CPU_TILED_MM", "0", 1);
    llama_backend_init();
    if (drafter_path) {
        dflash2_spec_abi abi = DFLASH2_SPEC_ABI_INIT;
        if (dflash2_spec_abi_check(&abi) != DFLASH2_OK) die("abi check");
    }
    struct llama_model_params mp = llama_model_default_params();
    mp.use_extra_bufts = false;
    struct llama_model *model = llama_model_load_from_file(target_path, mp);
    if (!model) { fprintf(stderr, "frontend: cannot load %s\n", target_path); return 1; }
    const struct llama_vocab *vocab = llama_model_get_vocab(model);

    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 2048;
    cp.n_batch = cp.n_ubatch = 512;
    cp.n_seq_max = 1;
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED; /* its CPU kernel rounds one row apart */
    cp.n_threads = cp.n_threads_batch = 2;
    dflash2_spec_capture *cap = NULL;
    if (drafter_path && capture && dflash2_spec_capture_new(model, drafter_path, &cp, &cap) != DFLASH2_OK)
        die("capture");
    struct llama_context *ctx = llama_init_from_model(model, cp);
    if (!ctx) { fprintf(stderr, "frontend: cannot create a context\n"); return 1; }

    dflash2_spec *spec = NULL;
    dflash2_spec_info info;
    if (drafter_path) {
        dflash2_spec_params sp = dflash2_spec_default_params();
        sp.block_size = (uint32_t)block;
        sp.select = !strcmp(select, "best-path") ? DFLASH2_SELECT_BEST_PATH : DFLASH2_SELECT_GREEDY;
        sp.temperature = match ? 0.0f : temp;
        sp.seed = seed;
        sp.n_threads = 2;
        sp.capture = cap;
        if (dflash2_spec_init(model, ctx, drafter_path, &sp, 1, &spec) != DFLASH2_OK) die("spec init");
        if (dflash2_spec_get_info(spec, &info) != DFLASH2_OK) die("spec info");
    }

    int n_prompt = -llama_tokenize(vocab, prompt, (int32_t)strlen(prompt), NULL, 0, true, true);
    llama_token *tokens = malloc(sizeof(llama_token) * (size_t)(n_prompt + n_predict + MAX_BLOCK));
    llama_tokenize(vocab, prompt, (int32_t)strlen(prompt), tokens, n_prompt, true, true);
    struct llama_batch batch = llama_batch_init(512, 0, 1);
    llama_memory_t mem = llama_get_memory(ctx);

    for (int run = 0; run < runs; run++) {
        struct llama_sampler *chain = make_chain(temp, seed + (uint32_t)run);
        /* the prompt's cells decoded by an earlier run stay, but for its last token, whose logits
         * choose the first token; the speculator forgets the same positions */
        int keep = run == 0 ? 0 : n_prompt - 1;
        dflash2_spec_stats before = {0};
        llama_memory_seq_rm(mem, 0, keep, -1);
        if (spec && run == 0 && dflash2_spec_begin(spec, 0) != DFLASH2_OK) die("begin");
        if (spec && run > 0 && dflash2_spec_seq_rm(spec, 0, keep) != DFLASH2_OK) die("seq_rm");
        if (spec && dflash2_spec_get_stats(spec, 0, &before) != DFLASH2_OK) die("stats");

        /* prefill: the prompt (what the cache lacks of it) in one batch, logits for its last row */
        batch.n_tokens = 0;
        for (int i = keep; i < n_prompt; i++) {
            batch.token[i - keep] = tokens[i];
            batch.pos[i - keep] = i;
            batch.n_seq_id[i - keep] = 1;
            batch.seq_id[i - keep][0] = 0;
            batch.logits[i - keep] = i == n_prompt - 1;
            batch.n_tokens++;
        }
        if (llama_decode(ctx, batch)) { fprintf(stderr, "frontend: prefill failed\n"); return 1; }

        int n_out = 0, pos = n_prompt; /* pos: where the next token (not yet decoded) goes */
        llama_token next;
        int32_t rows[MAX_BLOCK + 1];
        llama_token draft[MAX_BLOCK], got[MAX_BLOCK + 1];
        size_t n_draft = 0, n_got = 0;
        int last_row = n_prompt - 1 - keep;
        for (;;) {
            /* the token after the rows just decoded */
            if (!spec) {
                next = llama_sampler_sample(chain, ctx, last_row);
                got[0] = next;
                n_got = 1;
            } else {
                if (dflash2_spec_process(spec, &batch) != DFLASH2_OK) die("process");
                for (int r = 0; r <= (int)n_draft; r++) rows[r] = last_row - (int)n_draft + r;
                dflash2_status st = temp > 0 && match
                    ? dflash2_verify_match(spec, 0, chain, ctx, rows, (int32_t)n_draft + 1, got, MAX_BLOCK + 1, &n_got)
                    : temp > 0
                    ? dflash2_verify_sample(spec, 0, chain, ctx, rows, (int32_t)n_draft + 1, got, MAX_BLOCK + 1, &n_got)
                    : dflash2_verify_greedy(spec, 0, chain, ctx, rows, (int32_t)n_draft + 1, got, MAX_BLOCK + 1, &n_got);
                if (st != DFLASH2_OK) die("verify");
                /* keep the anchor and the accepted drafts, drop the rejected ones */
                llama_memory_seq_rm(mem, 0, pos - (int)n_draft + (int)n_got - 1, -1);
                pos = pos - (int)n_draft + (int)n_got - 1;
            }
            int done = 0;
            for (size_t k = 0; k < n_got && !done; k++) {
                if (llama_vocab_is_eog(vocab, got[k]) || n_out >= n_predict) { done = 1; break; }
                printf("%s%d", n_out ? " " : "", got[k]);
                n_out++;
            }
            if (done || n_out >= n_predict) break;
            next = got[n_got - 1];

            /* draft after `next`, then decode [next, drafts...] in one batch */
            n_draft = 0;
            size_t room = (size_t)(n_predict - n_out - 1); /* the cycle's own token is the last one asked */
            if (spec && room > 0) {
                if (dflash2_spec_draft(spec, 0, next, pos, draft, room < MAX_BLOCK ? room : MAX_BLOCK, &n_draft) != DFLASH2_OK)
                    die("draft");
            }
            batch.n_tokens = 0;
            for (size_t k = 0; k <= n_draft; k++) {
                batch.token[k] = k == 0 ? next : draft[k - 1];
                batch.pos[k] = pos + (int)k;
                batch.n_seq_id[k] = 1;
                batch.seq_id[k][0] = 0;
                batch.logits[k] = 1;
                batch.n_tokens++;
            }
            double t0 = now_ms();
            if (llama_decode(ctx, batch)) { fprintf(stderr, "frontend: decode failed\n"); return 1; }
            if (spec) dflash2_spec_report_verify(spec, batch.n_tokens, now_ms() - t0);
            last_row = (int)n_draft;
            pos += (int)n_draft + 1;
        }
        printf("\n");
        fflush(stdout);
        llama_sampler_free(chain);
        if (spec) {
            /* this run's share of the sequence's counters (a reused prompt's first verify counts
             * as a cycle: only begin marks the prompt's token) */
            dflash2_spec_stats st;
            if (dflash2_spec_get_stats(spec, 0, &st) != DFLASH2_OK) die("stats");
            unsigned long long cycles = st.cycles - before.cycles, accepted = st.n_accepted - before.n_accepted;
            fprintf(stderr, "frontend: run %d: tau %.4f cycles %llu drafts %llu drafted %llu accepted %llu (features: %s)\n",
                    run, cycles ? (double)(cycles + accepted) / (double)cycles : 0.0, cycles,
                    (unsigned long long)(st.drafts - before.drafts), (unsigned long long)(st.n_drafted - before.n_drafted),
                    accepted, info.feature_source == DFLASH2_FEATURES_NATIVE ? "native" : "callback");
        }
    }
    llama_batch_free(batch);
    free(tokens);
    dflash2_spec_free(spec);
    llama_free(ctx);
    dflash2_spec_capture_free(cap);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
