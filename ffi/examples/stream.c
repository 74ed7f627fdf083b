/*
 * stream.c: load a target and a DFlash drafter, stream one chat reply, print the statistics.
 *
 *   cc -std=c99 stream.c $(pkg-config --cflags --libs dflash2) -o stream
 *   ./stream TARGET.gguf DRAFTER.gguf ["PROMPT" [N_PREDICT]]
 *
 * The reply goes to stdout (followed by one newline), the statistics to stderr.
 */
#include <dflash2.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int fail(const char *what) {
    fprintf(stderr, "stream: %s: %s\n", what, dflash2_last_error());
    return 1;
}

static int print_piece(const char *text, size_t len, void *user_data) {
    (void)user_data;
    fwrite(text, 1, len, stdout);
    fflush(stdout);
    return 0; /* non-zero would stop the generation */
}

/* Render the prompt as one user turn and tokenize it. Returns NULL on failure. */
static dflash2_token *chat_prompt(const dflash2_engine *engine, const char *prompt, size_t *n_tokens) {
    dflash2_chat_message msg = {"user", prompt};
    size_t len = 0;
    /* First call: size query (NULL buffer, capacity 0). */
    if (dflash2_apply_chat_template(engine, &msg, 1, true, NULL, 0, &len) != DFLASH2_ERR_BUFFER_TOO_SMALL)
        return NULL;
    char *text = malloc(len + 1);
    if (!text || dflash2_apply_chat_template(engine, &msg, 1, true, text, len + 1, &len) != DFLASH2_OK) {
        free(text);
        return NULL;
    }
    dflash2_token *tokens = NULL;
    if (dflash2_tokenize(engine, text, len, true, true, NULL, 0, n_tokens) == DFLASH2_ERR_BUFFER_TOO_SMALL) {
        tokens = malloc(*n_tokens * sizeof *tokens);
        if (tokens && dflash2_tokenize(engine, text, len, true, true, tokens, *n_tokens, n_tokens) != DFLASH2_OK) {
            free(tokens);
            tokens = NULL;
        }
    }
    free(text);
    return tokens;
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s TARGET.gguf DRAFTER.gguf [PROMPT [N_PREDICT]]\n", argv[0]);
        return 2;
    }
    const char *prompt = argc > 3 ? argv[3] : "Write a haiku about the sea.";
    uint32_t n_predict = argc > 4 ? (uint32_t)strtoul(argv[4], NULL, 10) : 64;

    dflash2_engine_params params;
    dflash2_engine_params_init(&params);
    params.target_path = argv[1];
    params.drafter_path = argv[2];
    params.n_ctx = 2048;

    dflash2_engine *engine = NULL;
    if (dflash2_engine_new(&params, &engine) != DFLASH2_OK)
        return fail("loading the models");

    dflash2_session *session = NULL;
    size_t n_tokens = 0;
    dflash2_token *tokens = NULL;
    dflash2_stats stats;
    int rc = 1;
    if (dflash2_session_new(engine, &session) != DFLASH2_OK) {
        fail("creating a session");
    } else if (!(tokens = chat_prompt(engine, prompt, &n_tokens))) {
        fail("building the prompt");
    } else if (dflash2_session_feed(session, tokens, n_tokens, n_predict) != DFLASH2_OK) {
        fail("decoding the prompt");
    } else if (dflash2_session_generate(session, print_piece, NULL) != DFLASH2_OK) {
        fail("generating");
    } else if (dflash2_session_stats(session, &stats) != DFLASH2_OK) {
        fail("reading the statistics");
    } else {
        printf("\n");
        fprintf(stderr,
                "dflash2 %s: %llu tokens, %.1f tokens/s, tau %.2f, %llu drafted, %llu accepted, finish %d\n",
                dflash2_version(), (unsigned long long)stats.n_generated, stats.tokens_per_second, stats.tau,
                (unsigned long long)stats.n_drafted, (unsigned long long)stats.n_accepted, (int)stats.finish);
        rc = 0;
    }
    free(tokens);
    dflash2_session_free(session);
    dflash2_engine_free(engine);
    return rc;
}
