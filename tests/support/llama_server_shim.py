#!/usr/bin/env python3
"""Stands in for `llama-server` so that llama.cpp's server test suite drives `dflash2 serve`.

Translates llama-server's flags (as the suite's utils.py passes them) into dflash2's and
replaces the process with the server, so the suite's terminate() reaches it. Hub models map
to the GGUFs tests/support/fetch-models.sh installs. Flags that change nothing a client sees
here are dropped; flags for features this server does not have make the launcher exit 2 with
the reason, so those tests fail at start instead of passing by accident.

Environment: DFLASH2_BIN (default target/release/dflash2), DFLASH2_MODELS (default models/),
DFLASH2_SHIM_NO_DRAFTER=1 to decode plainly.
"""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODELS = os.environ.get("DFLASH2_MODELS", os.path.join(ROOT, "models"))
SMOLLM2 = "SmolLM2-135M-Instruct.Q4_1.gguf"
QWEN_CODER = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
SMOLLM2_DRAFTER = os.path.join(ROOT, "gguf-drafters", "smollm2-135m-instruct.dflash2.gguf")

# The suite's hub models (repo, or repo/file) and what stands in for each. Qwen2.5-Coder has
# fill-in-the-middle tokens (infill) and a template that writes tools; SmolLM2 serves the rest.
HUB_MODELS = {
    "ggml-org/test-model-stories260K": SMOLLM2,
    "ggml-org/test-model-stories260K-infill": QWEN_CODER,
    "ggml-org/stories15M_MOE": SMOLLM2,
    "ggml-org/models": SMOLLM2,  # tinyllamas, and bert / jina (embeddings and rerank answer 501)
    "ggml-org/tinygemma3-GGUF": SMOLLM2,  # vision is not built: image parts are refused
    "ggml-org/Qwen2.5-Coder-1.5B-IQ3_XXS-GGUF": QWEN_CODER,
    "bartowski/Meta-Llama-3.1-8B-Instruct-GGUF": QWEN_CODER,
    "bartowski/Phi-3.5-mini-instruct-GGUF": QWEN_CODER,
    "bartowski/DeepSeek-R1-Distill-Qwen-7B-GGUF": QWEN_CODER,
}

# llama-server flag -> dflash2 flag, value passed on.
RENAMED = {
    "--port": "--port", "--host": "--host", "--temp": "--temp", "--seed": "--seed",
    "--alias": "--alias", "--ctx-size": "--ctx-size", "-c": "--ctx-size",
    "--parallel": "--parallel", "-np": "--parallel", "--n-predict": "--n-predict", "-n": "--n-predict",
    "--api-key": "--api-key", "--threads": "--threads", "-t": "--threads", "--tags": "--tags",
    "--chat-template": "--chat-template", "--chat-template-file": "--chat-template-file",
    "-ctk": "--cache-type-k", "--cache-type-k": "--cache-type-k",
    "-ctv": "--cache-type-v", "--cache-type-v": "--cache-type-v",
    "--batch-size": "--batch-size", "-b": "--batch-size", "--cors-origins": "--cors-origins",
}
SWITCHES = {"--slots": "--slots", "--no-slots": "--no-slots", "--verbose": "--verbose"}

# Dropped with their value: the micro-batch, offload and attention kernels do not change answers
# here.
DROPPED_VALUE = {"--ubatch-size", "-ub", "--n-gpu-layers", "-ngl", "-fa",
                 "--flash-attn", "--cache-ram", "--reasoning-format",
                 "--spec-draft-n-min", "--spec-draft-n-max", "--hf-token"}
# Dropped switches: continuous batching, the chat template's Jinja rendering and /metrics are
# always on; the rest concern llama-server's web UI, downloads or its unified KV cache.
DROPPED_SWITCH = {"--offline", "--cont-batching", "--metrics", "--kv-unified", "--swa-full",
                  "--no-ui", "--jinja", "--no-jinja", "--no-cache-idle-slots",
                  "--no-mmproj", "--embedding", "--embeddings", "--reranking", "--rerank"}

# Features not built: the launcher refuses them, naming why.
REFUSED = {
    "--lora": "LoRA adapters are not built (a drafter is trained against one fixed target)",
    "--slot-save-path": "saving and restoring slot caches is not built",
    "--context-shift": "context shift is not built: a request past its slot's context stops",
    "--grp-attn-n": "group attention (self-extend) is not built",
    "--grp-attn-w": "group attention (self-extend) is not built",
    "--models-dir": "router mode (several models) is not built: one server serves one model",
    "--models-preset": "router mode (several models) is not built",
    "--models-max": "router mode (several models) is not built",
    "--no-models-autoload": "router mode (several models) is not built",
    "--mmproj-url": "multimodal input is not built",
    "--media-path": "multimodal input is not built",
    "--sleep-idle-seconds": "unloading the model when idle is not built",
    "--tools": "llama-server's built-in server tools are not built",
    "--tools-runtime": "llama-server's built-in server tools are not built",
    "--mcp-servers-config": "the MCP proxy is not built",
    "--mcp-servers-json": "the MCP proxy is not built",
    "--ui-mcp-proxy": "the MCP proxy is not built",
    "--pooling": "embeddings are not built",
    "--model-url": "models are not downloaded: give a local file",
    "--reasoning": "reasoning-format parsing is not built",
    "--backend_sampling": "backend sampling is not built",
}
SWITCH_FLAGS = DROPPED_SWITCH | set(SWITCHES) | {"--ui-mcp-proxy", "--no-models-autoload",
                                                 "--context-shift", "--backend_sampling"}


def note(msg):
    print(f"llama-server shim: {msg}", file=sys.stderr, flush=True)


def refuse(msg):
    note(f"refused: {msg}")
    sys.exit(2)


def hub_model(repo, file):
    repo = repo.split(":")[0]  # a quantization tag: one file stands in for all
    name = HUB_MODELS.get(repo)
    if name is None:
        note(f"unknown hub model {repo}/{file or ''}: serving {SMOLLM2}")
        name = SMOLLM2
    return os.path.join(MODELS, name)


def translate(argv):
    out, model, repo, file, draft, spec_type = [], None, None, None, None, None
    i = 0
    while i < len(argv):
        flag = argv[i]
        value = argv[i + 1] if flag not in SWITCH_FLAGS and i + 1 < len(argv) else None
        i += 1 if flag in SWITCH_FLAGS else 2
        if flag in REFUSED:
            refuse(f"{flag}: {REFUSED[flag]}")
        elif flag in RENAMED:
            out += [RENAMED[flag], value]
        elif flag in SWITCHES:
            out.append(SWITCHES[flag])
        elif flag in ("--model", "-m"):
            model = value
        elif flag in ("--hf-repo", "-hf"):
            repo = value
        elif flag in ("--hf-file", "-hff"):
            file = value
        elif flag in ("--model-draft", "-md"):
            draft = value
        elif flag == "--spec-type":
            spec_type = value
        elif flag in DROPPED_VALUE or flag in DROPPED_SWITCH:
            note(f"dropped {flag}{' ' + value if value is not None else ''}: changes nothing a client sees here")
        else:
            refuse(f"{flag}: no such flag here")
    if model is None and repo is None:
        # The suite starts every preset once before any test, the router's too: refusing would
        # stop the whole run, so the router's tests meet a one-model server instead.
        note(f"no model (router mode, not built): serving {SMOLLM2}")
        model = os.path.join(MODELS, SMOLLM2)
    elif model is None:
        model = hub_model(repo, file)
    out = ["serve", "--model", model] + out
    if spec_type not in (None, "draft-simple"):
        refuse(f"--spec-type {spec_type}: only a draft model (here a DFlash drafter) is built")
    # A llama-server draft model stands for speculative decoding: SmolLM2's DFlash drafter does it
    # here, for every SmolLM2 server, since a drafter never changes what a client is answered.
    if draft is not None:
        note(f"--model-draft {draft}: the SmolLM2 DFlash drafter drafts instead")
    if os.path.basename(model) == SMOLLM2 and os.environ.get("DFLASH2_SHIM_NO_DRAFTER") != "1":
        out += ["--drafter", SMOLLM2_DRAFTER]
    return out


def main():
    binary = os.environ.get("DFLASH2_BIN", os.path.join(ROOT, "target", "release", "dflash2"))
    args = translate(sys.argv[1:])
    note(" ".join([binary] + args))
    os.execv(binary, [binary] + args)


if __name__ == "__main__":
    main()
