#!/usr/bin/env bash
# Seeds of the fuzz corpora: valid inputs of each target, from which libFuzzer's mutations start.
# Run once before a first campaign (README.md "Fuzzing"); the committed corpora grew from these
# and were minimised with `cargo fuzz cmin`. Needs the release binary and the training venv
# (`tests/support/setup.sh --train`) for the checkpoint seed.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${DFLASH2_BIN:-target/release/dflash2}
S=$(mktemp -d)
trap 'rm -rf "$S"' EXIT
C=fuzz/corpus
mkdir -p $C/gguf $C/http $C/conversations $C/checkpoint

# gguf: the headers of the synthetic target and drafters (the harness's own, seed 3), up to their
# tensor data (the harness fills in zeros)
"$BIN" synth --out "$S/models" --seed 3 >/dev/null
for f in target drafter-dflash1 drafter-dflash2; do
    n=$(.venv/bin/python -c "from gguf import GGUFReader; print(GGUFReader('$S/models/$f.gguf').data_offset)")
    head -c "$n" "$S/models/$f.gguf" > "$C/gguf/seed-$f"
done

# http: [route, flags, body...] (route: an index into harness.rs's ROUTES; flags 0x01: the API key)
python3 - "$C/http" <<'PY'
import json, sys, os
out = sys.argv[1]
tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}}
chat = [{"role": "user", "content": "hi"}]
seeds = [
    (0, {"messages": chat, "max_tokens": 4, "temperature": 0.7, "stream": True}),
    (0, {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
         "tools": [tool], "tool_choice": "auto", "max_tokens": 4, "logprobs": True, "top_logprobs": 2}),
    (0, {"messages": chat, "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object", "properties": {"a": {"type": "string"}}}}}, "max_tokens": 4}),
    (2, {"messages": chat}),
    (3, {"prompt": ["Once upon", [1, 2, 3]], "max_tokens": 3, "n": 2, "logit_bias": {"5": -100}, "stop": ["\n"]}),
    (4, {"input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}], "instructions": "Be brief.", "max_output_tokens": 4, "stream": True}),
    (5, {"input": "hi"}),
    (6, {"model": "x", "max_tokens": 4, "system": "Be brief.", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "stream": True}),
    (7, {"model": "x", "messages": chat}),
    (8, {"prompt": "Once upon", "n_predict": 4, "n_probs": 2, "grammar": "root ::= [a-z]+", "return_tokens": True, "timings_per_token": True}),
    (8, {"prompt": [{"prompt_string": "a"}, "b"], "n_predict": 2, "samplers": ["top_k", "temperature"], "response_fields": ["content"], "return_progress": True, "stream": True}),
    (10, {"input_prefix": "def f(", "input_suffix": "\n", "input_extra": [{"filename": "a.py", "text": "x = 1\n"}], "n_predict": 4}),
    (11, {"messages": chat}),
    (12, {"content": "hello world", "add_special": True, "with_pieces": True}),
    (13, {"tokens": [1, 2, 3]}),
    (14, None), (15, None), (16, None), (18, None), (19, None),
]
for i, (route, body) in enumerate(seeds):
    data = json.dumps(body).encode() if body is not None else b""
    with open(os.path.join(out, f"seed-{i:02d}"), "wb") as f:
        f.write(bytes([route, 0x01]) + data)
PY

# conversations: the rows `dflash2 dataset` reads
cat > "$C/conversations/seed-rows" <<'EOF'
{"prompt": "question about the fox", "answer": "the quick brown fox jumps over the lazy dog"}
{"text": "once upon a time there was a little model that drafted blocks"}
{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
EOF

# checkpoint: [len(config.json) as u16 LE] config.json [the JSON header of model.safetensors] of a
# checkpoint trained one step on the synthetic target as tests/fuzz.rs trains it (the harness fills
# in the tensor data)
cat > "$S/conv.jsonl" <<'EOF'
{"prompt": "question 0 about the fox", "answer": "the quick brown fox jumps over the lazy dog the quick brown fox"}
{"prompt": "question 1 about the fox", "answer": "the quick brown fox jumps over the lazy dog the quick brown fox"}
EOF
"$BIN" dataset -m "$S/models/target.gguf" --conversations "$S/conv.jsonl" --out "$S/data.safetensors" --layers 1,2 -t 1 2>/dev/null
.venv/bin/python gguf-drafters/train/train.py --target "$S/models/target.gguf" --data "$S/data.safetensors" --out "$S/ckpt" \
    --layers 1 --rank 8 --top-k 4 --draft-vocab 64 --steps 1 --threads 1 --eval-every 100 >/dev/null
python3 - "$S/ckpt" "$C/checkpoint/seed-ckpt" <<'PY'
import json, struct, sys
ckpt, out = sys.argv[1], sys.argv[2]
config = json.dumps(json.load(open(f"{ckpt}/config.json"))).encode()
weights = open(f"{ckpt}/model.safetensors", "rb").read()
header = weights[8:8 + struct.unpack("<Q", weights[:8])[0]]
with open(out, "wb") as f:
    f.write(struct.pack("<H", len(config)) + config + header)
PY
ls $C/* | head -50
